"""HTTP front end: OpenAI-compatible API, config loading and the `python -m server` entry point."""
