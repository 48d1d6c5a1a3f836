"""Worker: model runner, sampler and cache tiers (rank 0 runs in the engine process)."""

from worker.runner import ModelRunner

__all__ = ["ModelRunner"]
