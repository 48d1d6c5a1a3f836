"""The engine process: builds the engine, then relays frames between its loop and the front end.

Started by server/engine_process.py (the front end) with the "spawn" context, so it is a fresh interpreter with no
FastAPI and none of the front end's threads. The engine loop (EngineCore) runs on its own thread and
sends each step's outputs as one frame; this process's main thread receives requests and aborts, sends
EngineStats when they change, and ends the process when the front end says so, when the front end's
process is gone (no orphans), or when the loop thread died (after telling the front end).

A CheckGrammar is answered from the grammar compiler's thread when the compile ends (the outbox is
locked, so any thread may send).

Sockets (ZeroMQ, addresses chosen by the front end): this side binds the requests PULL socket and
connects the outputs PUSH socket; both ends leave the high-water marks unbounded, so neither the
engine loop nor the front end ever waits on the other.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq

from contract import (
    Abort,
    CheckGrammar,
    EngineFailed,
    EngineReady,
    EngineStats,
    GrammarChecked,
    NewRequest,
    RequestOutput,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from contract.codec import decode, encode
from contract.messages import FromEngine

if TYPE_CHECKING:  # the engine's modules import torch: loaded only inside the spawned process
    from contract.config import ServeConfig
    from engine.loop import EngineCore

log = logging.getLogger("ds4serve.engine")
STATS_INTERVAL_S = 1.0
LINGER_MS = 1000  # how long exit waits to flush the last frames to the front end


class Outbox:
    """The outputs socket, shared by the loop thread (outputs) and the main thread (ready, stats)."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, LINGER_MS)
        self._socket.connect(address)
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe

    def send(self, message: FromEngine) -> None:
        frame = encode(message)
        with self._lock:
            if not self._socket.closed:  # a step that outlived the loop's stop timeout reports to no one
                self._socket.send(frame)

    def send_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """One engine step's outputs, as one frame (the loop thread calls it)."""
        self.send(StepOutputs(tuple(outputs)))

    def close(self) -> None:
        with self._lock:
            self._socket.close()


def run_engine_process(config: ServeConfig, requests_address: str, outputs_address: str, log_level: int) -> None:
    """The process entry point. Exit code 0 after a shutdown or a lost front end, 1 after a failure.
    The engine's modules (torch, the model) are imported here, in the spawned process, never at module
    level: the front end imports this module to name the spawn target."""
    from contract.logs import configure_logging  # stdlib only: the same lines as the front end's
    from engine.factory import build_engine_core

    configure_logging(log_level, config.server.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front end stops us
    context = zmq.Context()
    outbox = Outbox(context, outputs_address)
    requests = context.socket(zmq.PULL)
    requests.setsockopt(zmq.RCVHWM, 0)
    requests.bind(requests_address)
    failure: str | None
    try:
        engine, spec = build_engine_core(config, outbox.send_outputs)
    except Exception as exc:  # reported to the front end, which refuses to start with this message
        log.exception("engine failed to start")
        outbox.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        failure = str(exc)
    else:
        outbox.send(EngineReady(limits=engine.scheduler.limits, device=spec.device, dtype=spec.dtype, model=spec.model))
        engine.start()
        failure = serve(engine, requests, outbox)
        engine.stop()
        engine.executor.close()  # no rank process outlives the engine
    requests.close(linger=0)
    outbox.close()
    context.term()
    if failure is not None:
        sys.exit(1)


def serve(engine: EngineCore, requests: zmq.Socket, outbox: Outbox) -> str | None:
    """Relays until told to stop; returns why the engine failed, or None for a normal end."""
    parent = multiprocessing.parent_process()
    assert parent is not None, "the engine runs in a child of the front end"
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    poller.register(parent.sentinel, zmq.POLLIN)
    sent_stats: EngineStats | None = None
    sent_at = time.monotonic()
    while True:
        events = dict(poller.poll(STATS_INTERVAL_S * 1000))
        if parent.sentinel in events:
            log.warning("the front end exited; stopping the engine")
            return None
        if not engine.alive:
            failure = f"the engine stopped: {engine.failure or 'its loop died (see the engine log)'}"
            outbox.send(EngineFailed(failure))
            return failure
        while requests.poll(0):
            if not handle(engine, decode(requests.recv()), outbox):
                return None
        if time.monotonic() - sent_at >= STATS_INTERVAL_S:
            stats, sent_at = engine.stats(), time.monotonic()
            if stats != sent_stats:
                outbox.send(stats)
                sent_stats = stats


def handle(engine: EngineCore, message: object, outbox: Outbox) -> bool:
    """Applies one front-end message; False for shutdown."""
    if isinstance(message, NewRequest):
        try:
            engine.submit(message)
        except RequestRejected as exc:  # the front end validated against the same limits; a safety net
            outbox.send_outputs([RequestOutput(
                message.request_id, finished=True, finish_reason="error", error=str(exc),
                num_prompt_tokens=len(message.prompt_token_ids),
            )])
    elif isinstance(message, Abort):
        engine.abort(message.request_id)
    elif isinstance(message, CheckGrammar):
        check_id = message.check_id
        engine.check_grammar(message.structured, lambda error: outbox.send(GrammarChecked(check_id, error)))
    else:
        assert isinstance(message, Shutdown), f"unexpected message {message!r}"
        return False
    return True
