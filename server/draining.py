"""uvicorn's Server with a drain in front of its shutdown.

On SIGTERM uvicorn stops listening at once and, once shut down, raises the signal again, so the process
dies by it instead of exiting 0. Here the first SIGTERM or SIGINT starts the front end's drain
(server/lifecycle.py) while the server keeps listening (so /health can tell a load balancer 503), and
uvicorn's shutdown starts only when the drain is over; the signal is not raised again, so a drained
server exits 0. A second signal cuts the drain short: running requests are cut off at once.

When the engine cannot be kept running (`engine_lost`, server/engine_supervisor.py), the server shuts
down at once (its calls have already failed) and `run` reports it, so the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import uvicorn

from server.launch import EngineLost
from server.lifecycle import Lifecycle


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, engine_lost: EngineLost) -> None:
        super().__init__(config)
        self.lifecycle, self.engine_lost = lifecycle, engine_lost
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain: asyncio.Task[None] | None = None  # held so the task is not collected mid-drain

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop asks every tick (0.1 s) whether to exit."""
        return self.engine_lost.reason is not None or await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler, on the loop's thread: only flags and a wake-up of the loop."""
        if self._loop is None:
            return super().handle_exit(sig, frame)
        if self._signalled:
            self._loop.call_soon_threadsafe(self.lifecycle.expired.set)
            self.should_exit = True
            return
        self._signalled = True
        self.lifecycle.begin_drain()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.lifecycle.drain()
        self.should_exit = True
