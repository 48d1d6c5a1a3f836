"""The front end's handle on the engine: one `EngineCall` per HTTP call, with one queue for the outputs of
all its engine requests (a request per choice and prompt).

The engine runs in its own process (server/engine_process.py relays to it). Its outputs, stats and
death are reported from a receiver thread and handed to the asyncio loop with call_soon_threadsafe
(one hand-over per engine step), so nothing here blocks the loop. A call validates its requests once,
when it is made (before an HTTP stream's 200); the engine process checks what arrives once more, since
frames cross a process boundary. When the engine dies, every open call ends with an error output and
new ones are refused. A request's output constraint is compiled by the engine before the request is
made (`check_grammar`), so a grammar that does not compile is the client's 400.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from contract import EngineStats, NewRequest, RequestOutput, StructuredOutput
from server.request_errors import ClientError


class EngineDeadError(RuntimeError):
    """The engine process is gone, so no request can run (the server stays up; /health says 503)."""


class EngineHandle(Protocol):
    def submit(self, request: NewRequest) -> None:
        """Sends a request that `validate` accepted."""

    def abort(self, request_id: str) -> None: ...

    def validate(self, request: NewRequest) -> None:
        """Raises RequestRejected for a request the engine would refuse."""

    def check_grammar(self, check_id: str, structured: StructuredOutput) -> None:
        """Asks the engine to compile `structured`; the answer comes to EngineClient.on_grammar_checked."""


class RequestObserver:
    """Watches one engine request through its call (metrics hang off this); the base class does nothing."""

    def output(self, output: RequestOutput) -> None:
        """Each output, as it is handed to the caller."""

    def ended(self, finished: bool, reason: str | None = None) -> None:
        """Once, last; finished is False when the caller left before the finished output (an abort);
        `reason` overrides the finish reason (a stop string the front end found)."""


class EngineCall:
    """One HTTP call's engine requests, validated when the call is made, submitted by `start`, their
    outputs read from one queue as (request index, output) until every request finished. Leaving
    early (`close`, or the async iteration abandoned) aborts the requests still running."""

    def __init__(self, client: EngineClient, engine: EngineHandle, requests: Sequence[NewRequest], n: int = 1) -> None:
        self._client, self._engine, self.requests = client, engine, tuple(requests)
        self.n = n  # choices per prompt: the requests are each prompt's n choices in turn
        self.queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._open: set[int] = set()
        self._stopped: set[int] = set()  # ended by the front end at a stop string
        self._observers: list[RequestObserver] = []
        self._started = False

    def start(self) -> None:
        """Submits every request (once; iterating starts the call too). Raises EngineDeadError."""
        if self._started:
            return
        self._started = True
        self._client.check_alive()
        self._observers = list(self._client.observe(self))
        for index, request in enumerate(self.requests):
            self._client.register(request.request_id, self, index)
            self._open.add(index)
            self._engine.submit(request)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for item in self._outputs(marks=False):
            assert item is not None, "no marks asked for"
            yield item

    def hand_overs(self) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """The outputs as iterating the call gives them, with a None each time the next one has not
        arrived yet (and before a failure is raised): what was read since the last None is one hand-over,
        which a stream sends as one frame per choice however many engine steps it spans."""
        return self._outputs(marks=True)

    async def _outputs(self, marks: bool = False) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        self.start()
        try:
            while self._open:
                if marks and self.queue.empty():
                    yield None
                index, output = await self.queue.get()
                if isinstance(output, Exception):  # `interrupt`: the caller is cut off
                    if marks:
                        yield None  # what was read before goes out before the failure
                    raise output
                if index not in self._open:  # what a request ended at a stop string still had in flight
                    continue
                self._observers[index].output(output)
                if output.finished:
                    self._end(index, finished=True)
                yield index, output
        finally:
            self.close()

    def stop(self, index: int) -> None:
        """The front end ends request `index` at a stop string: it is aborted in the engine, and the
        metrics count it as a finish with reason "stop", not as an abort."""
        if index in self._open:
            self._stopped.add(index)
            self._end(index, finished=False)

    def close(self) -> None:
        """Aborts what still runs (the caller left); safe to call twice."""
        for index in sorted(self._open):
            self._end(index, finished=False)

    def deliver(self, index: int, output: RequestOutput) -> None:
        self.queue.put_nowait((index, output))

    def interrupt(self, exc: Exception) -> None:
        """The iteration raises `exc` at its next output (the server's drain timed out, the engine died)."""
        self.queue.put_nowait((-1, exc))

    def _end(self, index: int, finished: bool) -> None:
        self._open.discard(index)
        request_id = self.requests[index].request_id
        self._client.unregister(request_id)
        if not finished:
            self._engine.abort(request_id)
        stopped = index in self._stopped
        self._observers[index].ended(finished or stopped, "stop" if stopped else None)


class EngineClient:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[str, tuple[EngineCall, int]] = {}  # request id -> its call and index there
        self._engine: EngineHandle | None = None
        self._checks: dict[str, asyncio.Future[str | None]] = {}  # grammar checks waiting for the engine
        self.dead_reason: str | None = None
        self.stats: EngineStats | None = None  # the engine's latest report
        # one observer per request of a call, in order (metrics group each prompt's choices)
        self.observe: Callable[[EngineCall], Sequence[RequestObserver]] = lambda call: [
            RequestObserver() for _ in call.requests]

    def connect(self, engine: EngineHandle) -> None:
        self._engine = engine

    @property
    def ready(self) -> bool:
        return self._engine is not None and self.dead_reason is None

    def validate(self, request: NewRequest) -> None:
        """Raises RequestRejected for a request the engine would refuse."""
        assert self._engine is not None, "engine not connected"
        self._engine.validate(request)

    def call(self, requests: Sequence[NewRequest], n: int = 1) -> EngineCall:
        """Validates every request (raises RequestRejected: nothing is sent then) and returns the
        call, not yet started; `requests` are each prompt's `n` choices in turn."""
        assert self._engine is not None, "engine not connected"
        for request in requests:
            self.validate(request)
        return EngineCall(self, self._engine, requests, n)

    async def check_grammar(self, structured: StructuredOutput) -> None:
        """Has the engine compile a request's output constraint before the request is made (it keeps
        the result for it); raises ClientError naming the field when it does not compile, so a bad
        schema is a 400 before any stream starts, EngineDeadError if the engine goes away meanwhile."""
        assert self._engine is not None, "engine not connected"
        self.check_alive()
        check_id = uuid.uuid4().hex
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._checks[check_id] = answer
        try:
            self._engine.check_grammar(check_id, structured)
            error = await answer
        finally:
            self._checks.pop(check_id, None)
        if error is not None:
            raise ClientError(error, structured.param)

    def on_grammar_checked(self, check_id: str, error: str | None) -> None:
        """Engine side; thread-safe."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._answer_check, check_id, error)

    def _answer_check(self, check_id: str, error: str | None) -> None:
        answer = self._checks.get(check_id)
        if answer is not None and not answer.done():
            answer.set_result(error)

    async def generate(self, request: NewRequest) -> AsyncIterator[RequestOutput]:
        """One request's outputs until the finished one (a call of one)."""
        async for _, output in self.call([request]):
            yield output

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def register(self, request_id: str, call: EngineCall, index: int) -> None:
        self._calls[request_id] = (call, index)

    def unregister(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

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
        """Engine side; thread-safe. Set first, so a request submitted after this sees it; every open
        call then ends with EngineDeadError (a 503: the server's fault, and transient)."""
        self.dead_reason = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def on_engine_restored(self) -> None:
        """Engine side; thread-safe: a new engine process is ready, calls are served again."""
        self.dead_reason = None

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            entry = self._calls.get(output.request_id)
            if entry is not None:
                entry[0].deliver(entry[1], output)

    def _fail_all(self, reason: str) -> None:
        for call in {id(call): call for call, _ in self._calls.values()}.values():
            call.interrupt(EngineDeadError(reason))
        for answer in self._checks.values():
            if not answer.done():
                answer.set_exception(EngineDeadError(reason))
