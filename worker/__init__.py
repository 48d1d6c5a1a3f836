"""Worker: model runner, sampler, CUDA graphs and the tensor-parallel pool (rank 0 runs in the engine
process). Imports torch: only the engine process and the ranks import this package."""

from worker.runner import ModelRunner

__all__ = ["ModelRunner"]
