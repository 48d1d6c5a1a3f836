"""uvicorn's server (with the drain in front of its shutdown) that logs the startup summary once it
listens, with the address its sockets really bound (port 0 included)."""

from __future__ import annotations

import logging
import socket

from server.draining import DrainingServer
from server.startup_summary import endpoints

log = logging.getLogger("ds4serve.launch")


class AnnouncedServer(DrainingServer):
    """Logs `app.state.summary` (server/startup_summary.py) once, when uvicorn's startup has bound."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            app = self.config.app
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            log.info("%s", app.state.summary.describe(url, endpoints(app)))
