"""What the engine loop needs from whatever runs its steps (a worker pool, one runner, a test double).

Every method is part of the protocol, so the loop never probes for optional ones: an executor with
nothing to maintain or cancel implements those as no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from contract.stats import EngramStats, ExpertOffloadStats
from contract.step import StepPlan, StepResult


class LaunchedStep(Protocol):
    def result(self) -> StepResult:
        """Waits for the step's results on the host; raising fails the step's requests, not the engine."""


@dataclass(frozen=True)
class DoneStep:
    """A step that ran to its end when it was launched (an executor that does not overlap steps)."""

    value: StepResult

    def result(self) -> StepResult:
        return self.value


class ModelExecutor(Protocol):
    # whether a decode chunk's input may be PENDING_TOKEN (the draw of the step launched before it,
    # resolved on the device): the engine then plans step N+1 while step N runs (overlapped scheduling)
    pending_inputs: bool
    # whether it proposes drafts after its steps (a speculative runner): a step whose chunks verify drafts
    # or draft next lands before the next is planned, since the next chunks take what it proposes
    proposes_drafts: bool

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step to its end; raising fails the step's requests, not the engine."""

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Starts one step and returns as soon as it is queued (a GPU executor: before its tokens reach
        the host), so the engine plans the next one meanwhile. Steps run in launch order; the engine
        calls each step's `result()` once, in order, and has at most two steps out. Raising fails the
        step's requests."""

    def maintain(self) -> bool:
        """Called on the engine thread between steps: repair what broke (restart failed ranks). True when
        it rebuilt the model state (every slot, snapshot and prefix-tier row is empty again), so the
        engine fails what ran and forgets its prefix points. Raising ends the engine (a fault it cannot
        recover from)."""

    def cancel(self, request_id: str) -> None:
        """The request was aborted: drop work queued for it (Engram prefetch hints)."""

    def engram_stats(self) -> EngramStats | None:
        """The Engram store's counters, None without a tiered store."""

    def offload_stats(self) -> ExpertOffloadStats | None:
        """Expert offload's counters (rank 0's layers), None without expert offload."""

    def health(self) -> str | None:
        """Why steps cannot run now (None: healthy); /health answers 503 while it is set."""

    def close(self) -> None:
        """Releases everything the executor started (rank processes); no step runs after it."""
