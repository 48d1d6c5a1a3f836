"""The error of a config.json that cannot describe a model: its own module, so config.py and
config_v41.py (which config.py builds on) both raise it without importing each other in a circle."""


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4 model; the message names the key."""
