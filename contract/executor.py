"""What the engine loop needs from whatever runs its steps (a worker pool, one runner, a test double).

Every method is part of the protocol, so the loop never probes for optional ones: an executor with
nothing to maintain or cancel implements those as no-ops.
"""

from __future__ import annotations

from typing import Protocol

from contract.stats import EngramStats
from contract.step import StepPlan, StepResult


class ModelExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step; raising fails the step's requests, not the engine."""

    def maintain(self) -> bool:
        """Called on the engine thread between steps: repair what broke (restart failed ranks). True when
        it rebuilt the model state (every slot, snapshot and prefix-tier row is empty again), so the
        engine fails what ran and forgets its prefix points. Raising ends the engine (a fault it cannot
        recover from)."""

    def cancel(self, request_id: str) -> None:
        """The request was aborted: drop work queued for it (Engram prefetch hints)."""

    def engram_stats(self) -> EngramStats | None:
        """The Engram store's counters, None without a tiered store."""

    def health(self) -> str | None:
        """Why steps cannot run now (None: healthy); /health answers 503 while it is set."""

    def close(self) -> None:
        """Releases everything the executor started (rank processes); no step runs after it."""
