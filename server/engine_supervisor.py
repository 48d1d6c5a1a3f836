"""The engine handle the front end talks to: the running engine process, started again after it dies.

When the engine process dies (a crash, the OOM killer, SIGKILL), every open call ends at once with a
503-class error (EngineDeadError: "the engine process died ..."), new calls get 503, and /health says
503 with the reason. A new engine process is then started in place, with the same config, up to
`server.engine_restarts` times within `server.engine_restart_window_s`; once it is ready, /health
turns 200 and calls are served again. Past that budget the server gives up: it exits non-zero, so a
supervisor (compose's `restart: unless-stopped`, systemd, Kubernetes) starts it fresh, as vLLM's
server does when its engine core dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from contract import EngineReady, NewRequest, StructuredOutput
from contract.config import ServeConfig
from server.engine_client import EngineClient
from server.engine_process import EngineProcess, EngineStartError

log = logging.getLogger("ds4serve.launch")


class EngineSupervisor:
    """Starts the engine (the constructor returns once it is ready; EngineStartError otherwise) and
    keeps one running while the restart budget lasts; `give_up(reason)` is called, from a thread, when
    it does not."""

    def __init__(self, config: ServeConfig, client: EngineClient, give_up: Callable[[str], None]) -> None:
        self._config, self._client, self._give_up = config, client, give_up
        self._restarts: deque[float] = deque()  # when each restart began, within the window
        self._stopped = False
        self._lock = threading.Lock()  # the current process is swapped by the restart thread
        self._process = EngineProcess(config, client, self._died)

    @property
    def ready(self) -> EngineReady:
        return self._process.ready

    @property
    def restarts(self) -> int:
        return len(self._restarts)

    def validate(self, request: NewRequest) -> None:
        self._process.validate(request)  # against the limits the running engine announced

    def submit(self, request: NewRequest) -> None:
        self._process.submit(request)

    def abort(self, request_id: str) -> None:
        self._process.abort(request_id)

    def check_grammar(self, check_id: str, structured: StructuredOutput) -> None:
        self._process.check_grammar(check_id, structured)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            process = self._process
        process.stop()

    def _died(self, reason: str) -> None:
        """The receiver thread of the dead process: fail what runs, then restart on a thread of its own
        (the dead process's receiver must end for its stop to finish)."""
        self._client.on_engine_dead(reason)
        threading.Thread(target=self._restart, args=(reason,), name="ds4serve-engine-restart", daemon=True).start()

    def _restart(self, reason: str) -> None:
        now = time.monotonic()
        window = self._config.server.engine_restart_window_s
        while self._restarts and now - self._restarts[0] > window:
            self._restarts.popleft()
        with self._lock:
            if self._stopped:
                return
            dead = self._process
        dead.stop()
        if len(self._restarts) >= self._config.server.engine_restarts:
            self._give_up(f"{reason}; {len(self._restarts)} restart(s) within {window:.0f} s already "
                          "(server.engine_restarts): exiting for the supervisor to restart the server")
            return
        self._restarts.append(now)
        log.warning("starting the engine again (%d of %d within %.0f s) after: %s", len(self._restarts),
                    self._config.server.engine_restarts, window, reason)
        try:
            process = EngineProcess(self._config, self._client, self._died)
        except EngineStartError as exc:
            self._give_up(f"{reason}; the engine did not start again: {exc}")
            return
        with self._lock:
            stopped, self._process = self._stopped, process
        if stopped:  # the server began its shutdown while the engine started
            process.stop()
            return
        self._client.on_engine_restored()
        log.warning("the engine is serving again")
