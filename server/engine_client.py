"""The front end's handle on the engine: submit / abort, and an async stream of outputs per request.

The engine runs its loop elsewhere (a thread of this process for now) and reports through
`on_output`, which may be called from any thread; outputs are handed to the asyncio loop safely.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Callable

from scheduler.request import Request, RequestOutput


class EngineClient:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._submit: Callable[[Request], None] | None = None
        self._validate: Callable[[Request], None] | None = None
        self._abort: Callable[[str], None] | None = None
        self.ready = False

    def connect(
        self, submit: Callable[[Request], None], abort: Callable[[str], None], validate: Callable[[Request], None]
    ) -> None:
        self._submit, self._abort, self._validate = submit, abort, validate
        self.ready = True

    def validate(self, request: Request) -> None:
        """Raises RequestRejected for a request the engine would refuse."""
        assert self._validate is not None, "engine not connected"
        self._validate(request)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def on_output(self, output: RequestOutput) -> None:
        """Engine side; thread-safe."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, output)

    def _deliver(self, output: RequestOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until the finished one; aborts the request if the caller leaves."""
        assert self._submit is not None and self._abort is not None, "engine not connected"
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            self._submit(request)  # raises RequestRejected before anything is queued
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self._abort(request.request_id)
