"""The front end's handle on the engine: submit / abort, and an async stream of outputs per request.

The engine runs in its own process (server/engine_process.py relays to it). Its outputs, stats and
death are reported from a receiver thread and handed to the asyncio loop with call_soon_threadsafe,
so nothing here blocks the loop. When the engine dies, every in-flight request ends with an error
output and new ones are refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from contract import EngineStats, NewRequest, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine process is gone, so no request can run (the server stays up; /health says 503)."""


class EngineHandle(Protocol):
    def submit(self, request: NewRequest) -> None:
        """Raises RequestRejected before anything is queued."""

    def abort(self, request_id: str) -> None: ...

    def validate(self, request: NewRequest) -> None:
        """Raises RequestRejected for a request the engine would refuse."""


class RequestObserver:
    """Watches one request through generate() (metrics hang off this); the base class does nothing."""

    def output(self, output: RequestOutput) -> None:
        """Each output, as it is handed to the caller."""

    def ended(self, finished: bool, reason: str | None = None) -> None:
        """Once, last; finished is False when the caller left before the finished output (an abort);
        `reason` overrides the finish reason (a stop string the front end found)."""


class EngineClient:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._engine: EngineHandle | None = None
        self.dead_reason: str | None = None
        self.stats: EngineStats | None = None  # the engine's latest report
        self.observe: Callable[[NewRequest], RequestObserver] = lambda _: RequestObserver()
        self._stopped_early: set[str] = set()  # requests the front end ended at a stop string

    def connect(self, engine: EngineHandle) -> None:
        self._engine = engine

    @property
    def ready(self) -> bool:
        return self._engine is not None and self.dead_reason is None

    def validate(self, request: NewRequest) -> None:
        """Raises RequestRejected for a request the engine would refuse."""
        assert self._engine is not None, "engine not connected"
        self._engine.validate(request)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """Engine side; thread-safe. One engine step's outputs, handed to the event loop in one call."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def on_stats(self, stats: EngineStats) -> None:
        """Engine side; thread-safe (one attribute swap)."""
        self.stats = stats

    def on_engine_dead(self, reason: str) -> None:
        """Engine side; thread-safe. Set first, so a request submitted after this sees it."""
        self.dead_reason = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self, reason: str) -> None:
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(request_id, finished=True, finish_reason="error", error=reason))

    async def generate(self, request: NewRequest) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until the finished one; aborts the request if the caller leaves."""
        assert self._engine is not None, "engine not connected"
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._engine.submit(request)  # raises RequestRejected before anything is queued or observed
        self._queues[request.request_id] = queue
        observer, finished = self.observe(request), False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                observer.output(output)
                yield output
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self._engine.abort(request.request_id)
            early = request.request_id in self._stopped_early
            self._stopped_early.discard(request.request_id)
            observer.ended(finished or early, "stop" if early else None)

    def stopped_early(self, request_id: str) -> None:
        """The front end ends this request at a stop string (then aborts it in the engine): the
        metrics count it as a finish with reason "stop", not as an abort."""
        self._stopped_early.add(request_id)
