"""The engine's executor: the tensor-parallel worker pool, of which rank 0 lives in the engine process.

With one rank the pool is rank 0's ModelRunner behind one more call. It exists from the start so the
engine loop already talks to "the pool": ranks 1..N-1 (their own processes, torch.distributed) will
receive each plan from here before rank 0 runs it, and rank 0's result stays the step's result.
"""

from __future__ import annotations

from scheduler.engine_core import ModelExecutor
from scheduler.plan import StepPlan, StepResult


class WorkerPool:
    def __init__(self, rank0: ModelExecutor) -> None:
        self.ranks: list[ModelExecutor] = [rank0]

    def execute(self, plan: StepPlan) -> StepResult:
        return self.ranks[0].execute(plan)

    def cancel(self, request_id: str) -> None:
        """An aborted request: rank 0 drops its pending Engram prefetches."""
        cancel = getattr(self.ranks[0], "cancel", None)
        if cancel is not None:
            cancel(request_id)

    def engram_stats(self) -> dict:
        stats = getattr(self.ranks[0], "engram_stats", None)
        return stats() if stats is not None else {}
