"""The front end's side of the engine process: spawn it, wait until it is ready, relay, stop it.

The engine (engine/process.py) runs in a process of its own, started with the "spawn" context
(a fork would copy this process's threads and event loop). Frames (contract/codec.py) travel over two
ZeroMQ ipc sockets in a private temp directory: requests (PUSH, connected from here, so frames queue
even before the engine binds) and outputs (PULL, bound here). Calls from the asyncio loop only enqueue
a frame. One receiver thread waits on the outputs socket and on the process's sentinel and hands
everything to the EngineClient; the sentinel is how a dead engine is noticed at once.

The process is not a daemon, so that it may start tensor-parallel ranks of its own later; `stop` runs
from the app's shutdown hook and, as a safety net, at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import tempfile
import threading
from collections.abc import Callable

import zmq

from contract import (
    Abort,
    CheckGrammar,
    EngineFailed,
    EngineReady,
    EngineStats,
    GrammarChecked,
    NewRequest,
    Shutdown,
    StepOutputs,
    StructuredOutput,
    validate_request,
)
from contract.codec import decode, encode
from contract.config import ServeConfig
from contract.messages import ToEngine
from engine.process import run_engine_process  # stdlib, zmq and contract only: the engine loads in the child
from server.engine_client import EngineClient

log = logging.getLogger("ds4serve.launch")
FLUSH_MS = 200  # after the engine exits, how long a last frame (its failure) may still take to arrive
SOCKET_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, less its NUL): ZeroMQ's ipc transport refuses longer


def _socket_dir() -> tempfile.TemporaryDirectory:
    """The directory of the engine's two sockets: in the temp dir, or in /tmp when a long TMPDIR would
    make their paths longer than a unix socket allows (the engine could not start otherwise)."""
    workdir = tempfile.TemporaryDirectory(prefix="ds4serve-engine-")
    if len(f"{workdir.name}/requests".encode()) <= SOCKET_PATH_MAX:
        return workdir
    workdir.cleanup()
    return tempfile.TemporaryDirectory(prefix="ds4serve-engine-", dir="/tmp")


class EngineStartError(ValueError):
    """The engine could not start. A ValueError because the CLI reports those as `cannot start: ...`."""


class EngineProcess:
    """A running engine process; the constructor returns only once the engine reported ready. Its
    outputs and stats go to `client`; its death (not a stop asked for) to `on_death(reason)`, once,
    from the receiver thread."""

    def __init__(self, config: ServeConfig, client: EngineClient, on_death: Callable[[str], None]) -> None:
        self._client, self._on_death = client, on_death
        self._workdir = _socket_dir()
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.SNDHWM, 0)
        self._requests.connect(f"ipc://{self._workdir.name}/requests")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(f"ipc://{self._workdir.name}/outputs")
        self._send_lock = threading.Lock()  # ZeroMQ sockets are not thread-safe
        self._receiver: threading.Thread | None = None
        self._stopping = self._stopped = False
        self._failure: str | None = None
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process,
            args=(config, f"ipc://{self._workdir.name}/requests", f"ipc://{self._workdir.name}/outputs",
                  logging.getLogger().getEffectiveLevel()),
            name="ds4serve-engine",
        )
        self.process.start()
        atexit.register(self.stop)
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._receiver = threading.Thread(target=self._receive, name="ds4serve-engine-outputs", daemon=True)
        self._receiver.start()

    def submit(self, request: NewRequest) -> None:
        """Sends a request `validate` accepted (the engine process checks what arrives once more)."""
        self._send(request)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def check_grammar(self, check_id: str, structured: StructuredOutput) -> None:
        self._send(CheckGrammar(check_id, structured))

    def validate(self, request: NewRequest) -> None:
        validate_request(self.ready.limits, request)

    def stop(self, timeout: float = 20.0) -> None:
        """Asks the engine to exit, then terminates and at last kills it; safe to call twice. The wait
        covers the prefix disk tier's flush on stop (up to 8 s, engine/loop.py) and the ranks' close;
        compose's stop_grace_period (45 s, 90 s on GPUs) covers this."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        atexit.unregister(self.stop)
        self._send(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine did not exit within %.0f s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._receiver is not None:
            self._receiver.join()
        with self._send_lock:
            self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self._workdir.cleanup()

    def _send(self, message: ToEngine) -> None:
        frame = encode(message)
        with self._send_lock:
            if not self._requests.closed:
                self._requests.send(frame, zmq.NOBLOCK)  # never waits: the high-water mark is unbounded

    def _wait_ready(self) -> EngineReady:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._outputs in events:
                message = decode(self._outputs.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineFailed):
                    raise EngineStartError(f"the engine failed to start: {message.error}")
            elif not self._outputs.poll(FLUSH_MS):
                raise EngineStartError(f"the engine process exited ({self._exit_status()}) before it was ready")

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._outputs in events:
                self._dispatch(decode(self._outputs.recv()))
            elif not self._outputs.poll(FLUSH_MS):
                break
        if not self._stopping:
            if self._failure is not None:
                reason = f"the engine failed: {self._failure}"
            else:
                reason = f"the engine process died ({self._exit_status()})"
            log.error("%s", reason)
            self._on_death(reason)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            self._client.on_outputs(message.outputs)
        elif isinstance(message, EngineStats):
            self._client.on_stats(message)
        elif isinstance(message, GrammarChecked):
            self._client.on_grammar_checked(message.check_id, message.error)
        else:
            assert isinstance(message, EngineFailed), f"unexpected message {message!r}"
            self._failure = message.error

    def _exit_status(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
