"""The engine loop: schedule -> execute -> update, on its own thread (of the engine process, when served).

Requests and aborts arrive through a thread-safe inbox; each step's outputs leave together through one
callback call (one frame per step on the wire). A failing step ends the requests it carried with an
error reason and the loop goes on (the server stays up). The executor is injected behind the
contract's ModelExecutor protocol, so this module never imports torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from contract import EngineStats, ModelExecutor, NewRequest, RequestOutput, StepTokens
from scheduler import Scheduler

log = logging.getLogger("ds4serve.engine")

OutputSink = Callable[[Sequence[RequestOutput]], None]  # called once per step with its outputs (never empty)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, on_outputs: OutputSink) -> None:
        self.scheduler, self.executor, self._sink = scheduler, executor, on_outputs
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.step_tokens = StepTokens()  # swapped whole, so stats() reads it from another thread
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
        return EngineStats(
            running=s.running, waiting=s.waiting, preemptions=s.preemptions, pages_total=s.blocks.total,
            pages_held=s.blocks.held, pages_cached=s.blocks.cached, steps=self.steps, last_step_tokens=s.last_step_tokens,
            prefix_cache_queries=s.prefix_queried_tokens, prefix_cache_hits=s.prefix_hit_tokens,
            step_tokens=self.step_tokens, engram=self.executor.engram_stats(), unhealthy=self.executor.health(),
        )

    def submit(self, request: NewRequest) -> None:
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
            self._emit(self.scheduler.fail_all(f"the engine stopped: {self.failure}"))

    def _maintain(self) -> None:
        """Lets the executor repair itself between steps (restart a failed tensor-parallel pool)."""
        self.executor.maintain()

    def _emit(self, outputs: Sequence[RequestOutput]) -> None:
        if outputs:
            self._sink(outputs)

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
                    self._emit([output])
                    self.executor.cancel(payload)  # drop the request's pending prefetches
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan.has_work:
            return
        if plan.num_tokens:  # a step of state copies only runs no tokens
            self.step_tokens = self.step_tokens.observe(plan.num_tokens)
        try:
            result = self.executor.execute(plan)
        except Exception as exc:  # a failing step fails its requests, not the engine
            log.exception("step failed")
            outputs, failed = self.scheduler.fail_all(f"engine step failed: {type(exc).__name__}: {exc}"), True
        else:
            outputs, failed = self.scheduler.update(plan, result), False
        self.steps += 1
        self._emit(outputs)
        if failed:
            self._maintain()  # e.g. a pool whose rank died restarts before the next step
        if not self.scheduler.has_work:
            self.scheduler.check_integrity()
