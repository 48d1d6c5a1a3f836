"""How a generation request fails, for every endpoint; server/http_errors.py maps each to its status."""

from __future__ import annotations


class ClientError(ValueError):
    """A request the client must fix; becomes HTTP 400 with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """The engine ended a request with an error (HTTP 500); the server goes on."""


class ServerShuttingDown(RuntimeError):
    """The drain timeout passed with this request still running (HTTP 503)."""
