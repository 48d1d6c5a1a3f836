"""Typed errors to HTTP statuses, each with an OpenAI error body `{"error": {message, type, param, code}}`.

| status | raised as |
| --- | --- |
| 400 | ClientError, ChatRequestError, RequestRejected, a body that fails validation or is not JSON / not UTF-8, a body without `Content-Type: application/json` (the message says so) |
| 401 | (server/http_edge.py: a missing or wrong key) |
| 404 | UnknownModel, an unknown route |
| 413 | (server/http_edge.py: a body over `server.max_body_bytes`) |
| 429 | QueueFull, with Retry-After |
| 499 | ClientGone (nobody reads it; nginx's code, for the access log) |
| 500 | RequestFailed (the engine failed the request) |
| 503 | Draining, ServerShuttingDown, EngineDeadError |

FastAPI's own 422 with a pydantic dump never reaches a client: a validation error becomes a 400 that
names the field (`param`) and says what it should be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract import RequestRejected
from server.chat import ChatRequestError
from server.engine_client import EngineDeadError
from server.lifecycle import Draining, QueueFull
from server.protocol import ErrorResponse, error_body
from server.request_errors import ClientError, RequestFailed, ServerShuttingDown


class UnknownModel(Exception):
    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"the model {asked!r} does not exist; this server serves {served!r}")


class ClientGone(Exception):
    """The client disconnected before its response was ready; its engine requests were aborted."""


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param), status_code=status, headers=headers)


def _common_prefix(locs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        same = 0
        while same < min(len(prefix), len(loc)) and prefix[same] == loc[same]:
            same += 1
        prefix = prefix[:same]
    return prefix


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for the first field that failed. A union field (`prompt`) fails once per
    member; those are joined into one message about the field, not its members' pydantic tags."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    field = [e for e in errors if tuple(e["loc"][:2]) == tuple(first["loc"][:2])]
    loc = _common_prefix([tuple(e["loc"]) for e in field]) if len(field) > 1 else tuple(first["loc"])
    param = ".".join(str(part) for part in (loc[1:] if loc[:1] == ("body",) else loc)) or None
    reasons = " or ".join(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in field))
    return (f"{param}: {reasons}" if param else reasons), param


def json_typed(content_type: str | None) -> bool:
    """`application/json` or `application/<anything>+json` (parameters such as charset aside): the
    media types FastAPI parses a body as JSON for; any other body reaches validation as raw bytes."""
    if not content_type:
        return False
    mime = content_type.partition(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def not_json_typed_message(content_type: str | None) -> str:
    sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    return f"the body must be a JSON object sent with Content-Type: application/json; this request has {sent}"


def install_error_handlers(app: FastAPI) -> None:
    def handle(exc_type: type[Exception], status: int, kind: str = "invalid_request_error", named: bool = False) -> None:
        """`named`: the exception type carries the request field at fault (`param`)."""
        async def handler(_: Request, exc: Exception) -> JSONResponse:
            return error_response(status, str(exc), kind, exc.param if named else None)  # type: ignore[attr-defined]

        app.add_exception_handler(exc_type, handler)

    handle(ClientError, 400, named=True)
    handle(ChatRequestError, 400, named=True)
    handle(RequestRejected, 400, named=True)
    handle(UnknownModel, 404, "not_found_error")
    handle(ClientGone, 499)
    handle(RequestFailed, 500, "internal_server_error")
    handle(Draining, 503, "service_unavailable")
    handle(ServerShuttingDown, 503, "service_unavailable")

    async def engine_dead(_: Request, exc: Exception) -> JSONResponse:  # not the client's fault, not transient
        return error_response(503, f"the engine is not running: {exc}", "service_unavailable")

    async def queue_full(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, QueueFull)
        return error_response(429, str(exc), "rate_limit_error", headers={"retry-after": str(exc.retry_after_s)})

    async def invalid_body(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        content_type = request.headers.get("content-type")
        if not json_typed(content_type):  # FastAPI did not parse it: the fault is the header, not the fields
            return error_response(400, not_json_typed_message(content_type), param="Content-Type")
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", "not_found_error")
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", explained
            return error_response(400, f"the body is not valid UTF-8: {exc.__cause__.reason} at byte {exc.__cause__.start}")
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(QueueFull, queue_full)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(StarletteHTTPException, http_error)


# What each status means in /openapi.json; every one of them has the OpenAI error body.
STATUS_MEANING = {
    400: "a client mistake: a field that fails validation, a body that is not JSON, a bad x-request-id",
    401: "a missing or wrong API key (when keys are set)",
    404: "the model named is not the one served",
    413: "the body is larger than server.max_body_bytes",
    429: "the queue is full (Retry-After says when to try again)",
    500: "the engine failed the request, or an unexpected error",
    503: "the engine is not running or not ready, or the server is draining",
}
EVERY_ROUTE = (400, 413, 500)  # the edge middleware and the last-resort handler answer these on any route


def describe_error_statuses(app: FastAPI, statuses: dict[str, tuple[int, ...]], open_paths: tuple[str, ...]) -> None:
    """/openapi.json states the statuses actually sent: not FastAPI's 422 (a validation error is a 400
    here), but 400/401/404/413/429/500/503 with the OpenAI error body. `statuses`: path -> what its
    route answers beyond EVERY_ROUTE and 401 (which every path outside `open_paths` may answer)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error_schema.pop("$defs", {}))
        components["ErrorResponse"] = error_schema
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, operations in schema.get("paths", {}).items():
            codes = {*EVERY_ROUTE, *statuses.get(path, ()), *(() if path in open_paths else (401,))}
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for code in sorted(codes):
                    responses[str(code)] = {"description": STATUS_MEANING[code], "content": error}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
