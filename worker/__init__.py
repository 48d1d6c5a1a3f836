"""Worker: model runner, sampler and cache tiers (rank 0 runs in the engine process).

`ModelRunner` is imported on first use, so the HTTP front end can read `worker.launch_env` without
loading torch."""

from __future__ import annotations

__all__ = ["ModelRunner"]


def __getattr__(name: str):
    if name == "ModelRunner":
        from worker.runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
