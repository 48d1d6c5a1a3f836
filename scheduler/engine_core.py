"""The engine loop: schedule -> execute -> update, on its own thread (of the engine process, when served).

Requests and aborts arrive through a thread-safe inbox; outputs leave through a callback. A failing
step ends the requests it carried with an error reason and the loop goes on (the server stays up).
The model executor is injected, so this module never imports torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

from scheduler.plan import StepPlan, StepResult
from scheduler.request import Request, RequestOutput
from scheduler.scheduler import Scheduler

log = logging.getLogger("ds4serve.engine")


class ModelExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


# Upper edges (seconds) of the Engram prefetch-wait histogram that the engine reports.
PREFETCH_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class EngineStats:
    """Load and cache figures for metrics; read off the loop's thread, so a snapshot, not a barrier."""

    running: int
    waiting: int
    preemptions: int = 0  # since start
    pages_total: int = 0
    pages_held: int = 0
    pages_cached: int = 0  # reusable by the prefix cache, evictable
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which found there
    steps: int = 0
    last_step_tokens: int = 0
    # Engram row store (V4.1): rows served per tier, disk reads, prefetch waits (cumulative buckets)
    engram_rows_resident: int = 0
    engram_rows_device_cache: int = 0
    engram_rows_host_cache: int = 0
    engram_rows_disk: int = 0
    engram_bytes_read: int = 0
    engram_read_errors: int = 0
    engram_wait_count: int = 0
    engram_wait_sum_s: float = 0.0
    engram_wait_buckets: tuple[int, ...] = ()
    unhealthy: str | None = None  # why the executor cannot run steps now (a tensor-parallel restart)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, on_output: Callable[[RequestOutput], None]) -> None:
        self.scheduler, self.executor, self.on_output = scheduler, executor, on_output
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.failure: str | None = None  # why the loop thread ended, if it failed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ds4serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        engram_stats = getattr(self.executor, "engram_stats", None)
        engram = engram_stats() if engram_stats is not None else {}
        return EngineStats(
            running=s.running, waiting=s.waiting, preemptions=s.preemptions, pages_total=s.blocks.total,
            pages_held=s.blocks.held, pages_cached=s.blocks.cached, steps=self.steps, last_step_tokens=s.last_step_tokens,
            prefix_cache_queries=s.prefix_queried_tokens, prefix_cache_hits=s.prefix_hit_tokens,
            unhealthy=getattr(self.executor, "unhealthy", None),
            **engram,
        )

    def submit(self, request: Request) -> None:
        """Validate first (raises RequestRejected for the caller), then queue for the loop."""
        self.scheduler.validate(request)
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._maintain()
                self._drain_inbox(block=not self.scheduler.has_work)
                if self.scheduler.has_work:
                    self.step()
        except Exception as exc:  # the loop cannot go on (e.g. a rank failed and the config says exit)
            log.exception("the engine loop stopped")
            self.failure = f"{type(exc).__name__}: {exc}"
            for output in self.scheduler.fail_all(f"the engine stopped: {self.failure}"):
                self.on_output(output)

    def _maintain(self) -> None:
        """Lets the executor repair itself between steps (restart a failed tensor-parallel pool)."""
        maintain = getattr(self.executor, "maintain", None)
        if maintain is not None:
            maintain()

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                self.scheduler.add(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                output = self.scheduler.abort(payload)  # type: ignore[arg-type]
                if output is not None:
                    self.on_output(output)
                    cancel = getattr(self.executor, "cancel", None)
                    if cancel is not None:  # drop the request's pending prefetches
                        cancel(payload)
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan.has_work:
            return
        try:
            result = self.executor.execute(plan)
        except Exception as exc:  # a failing step fails its requests, not the engine
            log.exception("step failed")
            outputs, failed = self.scheduler.fail_all(f"engine step failed: {type(exc).__name__}: {exc}"), True
        else:
            outputs, failed = self.scheduler.update(plan, result), False
        self.steps += 1
        for output in outputs:
            self.on_output(output)
        if failed:
            self._maintain()  # e.g. a pool whose rank died restarts before the next step
        if not self.scheduler.has_work:
            self.scheduler.check_integrity()
