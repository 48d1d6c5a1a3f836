"""ASGI middleware at the HTTP edge: request ids, bearer keys, the body size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses and the client's
disconnect message pass through untouched (a non-streaming completion watches for the disconnect to
abort its engine requests). Order, outermost first: request ids (so every response, a 401 or 413 or
an unexpected 500 included, carries `x-request-id`), then keys (an unauthenticated body is never
read), then the body limit. Keys are compared in constant time and never logged.

Below the ASGI app, OpenAIErrorH11Protocol gives uvicorn's own 400s (what h11 cannot parse, and a body
framed by both Content-Length and Transfer-Encoding) the same OpenAI error body.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
import orjson
from uvicorn.protocols.http.h11_impl import (
    DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
    H11Protocol,
)

from contract.logs import REQUEST_ID as LOGGED_REQUEST_ID
from server.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("ds4serve.server")
REQUEST_ID_HEADER = b"x-request-id"
# what ids from tracing systems look like (uuids, ulids, W3C trace ids, dotted or colon-joined parts)
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


async def send_error(
    send: Send, status: int, message: str, kind: str, param: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """An OpenAI error body, for middleware that answers before the app runs."""
    body = orjson.dumps(error_body(message, status, kind, param))
    response_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


class RequestIds:
    """Honours a valid `x-request-id` (else 400) or makes one; puts it in `scope["state"]["request_id"]`
    and on every response. Also the last resort for an unhandled exception: a 500 with an OpenAI body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = header(scope, REQUEST_ID_HEADER)
        valid = given is not None and REQUEST_ID.fullmatch(given) is not None
        request_id = given.decode() if valid else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        logged = LOGGED_REQUEST_ID.set(request_id)  # every log line of this request carries it
        try:
            if given is not None and not valid:
                return await send_error(send_with_id, 400, "x-request-id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                                        "invalid_request_error", "x-request-id")
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:
                raise  # too late for an error body; the server closes the connection
            log.exception("unhandled error in %s %s (request %s)", scope["method"], scope["path"], request_id)
            await send_error(send_with_id, 500, "internal server error", "internal_server_error")
        finally:
            LOGGED_REQUEST_ID.reset(logged)


class BearerKeys:
    """Every path but `open_paths` needs `Authorization: Bearer <key>` once keys are set."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: tuple[str, ...]) -> None:
        self.app, self.open_paths = app, open_paths
        self.keys = tuple(key.encode() for key in keys)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # constant time, and every key is compared, so timing says nothing about which one is close
        return sum(hmac.compare_digest(token.strip(), key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"] not in self.open_paths and not self._authorized(scope):
            return await send_error(send, 401, "invalid or missing API key", "authentication_error",
                                    headers=((b"www-authenticate", b"Bearer"),))
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body before the app runs and answers 413 once it passes `max_bytes`; the app
    then reads it from memory, and later receive() calls (the disconnect) go to the server."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes", "invalid_request_error")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class _StrictH11Connection(h11.Connection):
    """h11's parser plus one refusal it does not make: a request with both Content-Length and
    Transfer-Encoding (RFC 9112 6.3: a server may reject it, and a proxy in front may frame it the
    other way: request smuggling). Keeps the last parse error's reason for the 400's message."""

    reason = "the request is not valid HTTP/1.1"

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as error:
            self.reason = f"the request is not valid HTTP/1.1: {error}"
            raise
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.reason = "the request has both Content-Length and Transfer-Encoding; send one"
                raise h11.RemoteProtocolError(self.reason)
        return event


class OpenAIErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose own 400 (a request line or chunked body h11 cannot parse, an
    HTTP/0.9 line, Content-Length with Transfer-Encoding) is an OpenAI error body in JSON with an
    `x-request-id`, not uvicorn's plain text. Pass as `uvicorn.Config(http=OpenAIErrorH11Protocol)`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = _StrictH11Connection(h11.SERVER, limit if limit is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)

    def send_400_response(self, msg: str) -> None:
        reason = getattr(self.conn, "reason", msg)
        body = orjson.dumps(error_body(reason, 400, "invalid_request_error"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), (REQUEST_ID_HEADER, uuid.uuid4().hex.encode())]
        try:
            output = self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
            output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response had started already: too late for a body
            output = b""
        if output:
            self.transport.write(output)
        self.transport.close()
