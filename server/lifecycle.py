"""Admission and drain of the HTTP front end: the 429 when the queue is full, and SIGTERM's drain.

The front end counts the engine requests it has admitted and not yet seen end. Up to `max_num_seqs`
of them run; the rest wait, and a call whose requests (a completions call: prompts x n) do not all
fit in the waiting places left gets 429 with Retry-After, as a whole: a call is never admitted in
part, and never past `max_waiting`. This is the front end's own count, not the engine's stats (which
arrive late), so a burst is refused at once. A call larger than the whole queue (`max_num_seqs` +
`max_waiting`) could never be admitted, so it is the client's 400 (CallTooLarge), not a 429 to retry
forever; every other call is admitted once the server is idle enough.

Draining (the first SIGTERM or SIGINT): /health and /ready answer 503 at once, new generation calls
get 503, and admitted calls get `drain_timeout_s` to finish. When that passes, `expired` is set: a
stream still running ends with an error frame and [DONE], a call still waiting for its whole response
gets 503, and their engine requests are aborted. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Self

from server.request_errors import ClientError

log = logging.getLogger("ds4serve.server")
RETRY_AFTER_S = 1  # a waiting request usually leaves the queue within a decode burst
EXPIRED_GRACE_S = 5.0  # how long cut-off calls get to send their error frames after the drain timeout


class QueueFull(Exception):
    """The waiting queue is full: HTTP 429 with Retry-After."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"the server is busy ({waiting} requests waiting); retry later")
        self.retry_after_s = RETRY_AFTER_S


class CallTooLarge(ClientError):
    """A call with more engine requests than the queue holds at all: HTTP 400 naming `param`."""

    def __init__(self, count: int, capacity: int, param: str) -> None:
        super().__init__(
            f"this request makes {count} generations (prompts x n); the server holds at most {capacity} at "
            "once (scheduler.max_num_seqs + server.max_waiting): send fewer", param,
        )


class Draining(Exception):
    """The server is shutting down and takes no new work: HTTP 503."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class Admission:
    """Places held in the front end's queue; released once, by `with` or by whoever ends the call."""

    def __init__(self, lifecycle: Lifecycle, count: int) -> None:
        self._lifecycle, self._count = lifecycle, count

    def release(self) -> None:
        count, self._count = self._count, 0
        if count:
            self._lifecycle._release(count)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class Lifecycle:
    def __init__(self, max_running: int, max_waiting: int, drain_timeout_s: float) -> None:
        self.max_running, self.max_waiting, self.drain_timeout_s = max_running, max_waiting, drain_timeout_s
        self.in_flight = 0  # engine requests admitted and not yet ended
        self.draining = False
        self.expired = asyncio.Event()  # the drain timeout passed: cut off what still runs
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def waiting(self) -> int:
        return max(0, self.in_flight - self.max_running)

    @property
    def capacity(self) -> int:
        """Engine requests the front end holds at most: those running and those waiting."""
        return self.max_running + self.max_waiting

    def admit(self, count: int, param: str = "n") -> Admission:
        """Holds `count` engine requests' places until the admission is released; raises Draining,
        CallTooLarge (naming `param`, the field that made the call this large: n, or a completions
        call's prompt list) or QueueFull."""
        if self.draining:
            raise Draining()
        if count > self.capacity:
            raise CallTooLarge(count, self.capacity, param)
        if self.in_flight + count - self.max_running > self.max_waiting:
            raise QueueFull(self.waiting)
        self.in_flight += count
        self._idle.clear()
        return Admission(self, count)

    def _release(self, count: int) -> None:
        self.in_flight -= count
        if not self.in_flight:
            self._idle.set()

    def begin_drain(self) -> None:
        """Flips /health to 503 and refuses new work; safe to call from a signal handler."""
        self.draining = True

    async def drain(self) -> None:
        """Returns once admitted calls have ended, cutting them off after `drain_timeout_s`."""
        self.begin_drain()
        log.info("draining: %d requests in flight, up to %.0f s", self.in_flight, self.drain_timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
            return
        except TimeoutError:
            log.warning("drain timeout: cutting off %d requests", self.in_flight)
        self.expired.set()
        try:
            await asyncio.wait_for(self._idle.wait(), EXPIRED_GRACE_S)
        except TimeoutError:
            log.error("%d requests did not end after being cut off", self.in_flight)
