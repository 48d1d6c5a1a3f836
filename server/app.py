"""The HTTP application: OpenAI-compatible routes over an EngineClient.

Client mistakes become HTTP 4xx with an OpenAI-style error body; only an engine fault is a 5xx.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.scheduler import RequestRejected
from server.completions import ClientError, build_requests, create_completion, stream_completion
from server.engine_client import EngineClient, EngineDeadError
from server.protocol import CompletionRequest, ModelCard, ModelList, error_body
from server.tokenizer import TextTokenizer

log = logging.getLogger("ds4serve.server")
VERSION = "0.1.0"
OPEN_PATHS = ("/health", "/ready", "/version", "/metrics")


@dataclass(frozen=True)
class ServedModel:
    name: str
    root: str
    max_model_len: int


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param), status_code=status)


def create_app(engine: EngineClient, tokenizer: TextTokenizer, model: ServedModel, api_keys: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="ds4serve", version=VERSION)

    @app.on_event("startup")
    async def bind_engine_to_loop() -> None:
        engine.bind_loop(asyncio.get_running_loop())

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_keys and request.url.path not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            if not header.startswith("Bearer ") or header[len("Bearer "):] not in api_keys:
                return _error(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _error(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead_reason is not None:
            return _error(503, engine.dead_reason, "service_unavailable")
        if not engine.ready:
            return _error(503, "engine is starting", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, root=model.root, max_model_len=model.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model is not None and body.model != model.name:
            return _error(404, f"the model {body.model!r} does not exist; this server serves {model.name!r}", "not_found_error", "model")
        try:
            response_id, requests = build_requests(body, tokenizer, model.max_model_len)
            if body.stream:
                for request in requests:  # refuse before the 200 of a stream is sent
                    engine.validate(request)
                frames = stream_completion(body, response_id, requests, engine, tokenizer, model.name)
                return StreamingResponse(frames, media_type="text/event-stream")
            response = await create_completion(body, response_id, requests, engine, tokenizer, model.name)
        except (ClientError, RequestRejected) as exc:
            return _error(400, str(exc), param=getattr(exc, "param", None))
        except EngineDeadError as exc:  # not the client's fault, and not transient inside this request
            return _error(503, f"the engine is not running: {exc}", "service_unavailable")
        except RuntimeError as exc:
            log.error("completion failed: %s", exc)
            return _error(500, str(exc), "internal_server_error")
        return JSONResponse(response.model_dump(exclude_none=True))

    return app
