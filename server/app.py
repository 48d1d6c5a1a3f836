"""The HTTP application: OpenAI-compatible routes over an EngineClient.

Routes: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions, /v1/responses (and GET
/v1/responses/{id}), /tokenize, /detokenize, /version (these need the bearer key when keys are set), /health
and /ready (always open). Client mistakes become HTTP 4xx with an OpenAI error
body (server/http_errors.py); only engine faults are 5xx. The edge middleware (server/http_edge.py)
adds request ids, keys and the body limit; server/lifecycle.py holds the queue bound and the drain,
and lives at `app.state.lifecycle` for the CLI's SIGTERM handler.

A completion's engine requests are aborted whenever its client leaves: a stream when its response
ends early, a non-streaming call when the server sees the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from contract import NewRequest
from contract.config import ServerSection
from server.chat import ChatFormat
from server.chat_completions import (
    build_chat_call,
    create_chat_completion,
    stream_chat_completion,
)
from server.chat_protocol import ChatCompletionRequest
from server.completions import build_requests, create_completion, stream_completion
from server.engine_client import EngineClient
from server.http_edge import BearerKeys, BodyLimit, RequestIds
from server.http_errors import (
    ClientGone,
    UnknownModel,
    describe_error_statuses,
    error_response,
    install_error_handlers,
)
from server.lifecycle import Admission, Lifecycle
from server.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from server.request_errors import ClientError, ServerShuttingDown
from server.responses import build_responses_call, create_response
from server.responses_input import responses_params
from server.responses_protocol import ResponseObject, ResponsesRequest
from server.responses_store import ResponseStore
from server.responses_stream import stream_response
from server.tokenize_api import detokenize, tokenize
from server.tokenizer import TextTokenizer

log = logging.getLogger("ds4serve.server")
VERSION = "0.1.0"
OPEN_PATHS = ("/health", "/ready", "/metrics")
DEFAULT_SETTINGS = ServerSection()
T = TypeVar("T")
PREPARE_WORKERS = 4  # threads that tokenize and render requests (the tokenizer releases the GIL)


@dataclass(frozen=True)
class ServedModel:
    name: str
    root: str
    max_model_len: int
    max_num_seqs: int = 1  # sequences the engine runs at once; admitted requests beyond them wait
    aliases: tuple[str, ...] = ()  # more names a request's `model` may give (vLLM's --served-model-name A B)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class HeldStream(StreamingResponse):
    """An SSE response that, however it ends, closes its frames at once (so the engine requests of a
    client that left are aborted now, not when the generator is collected) and frees its queue places."""

    def __init__(self, frames: AsyncGenerator[bytes, None], admission: Admission) -> None:
        super().__init__(frames, media_type="text/event-stream")
        self._frames, self._admission = frames, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._frames.aclose()
            self._admission.release()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read already, so that is all receive says)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_cut_off(work: Awaitable[T], request: Request, expired: asyncio.Event) -> T:
    """`work`'s result; cancelled (which aborts its engine requests) if the client leaves first
    (ClientGone) or the drain times out (ServerShuttingDown)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    cut = asyncio.ensure_future(expired.wait())
    try:
        await asyncio.wait((task, gone, cut), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (task, gone, cut):
            waiter.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    if cut.done() and not cut.cancelled():
        raise ServerShuttingDown("the server is shutting down; the request was cut off")
    log.info("client left before its completion %s was ready; aborted", request.state.request_id)
    raise ClientGone("client closed the request")


def create_app(
    engine: EngineClient, tokenizer: TextTokenizer, model: ServedModel, api_keys: tuple[str, ...] = (), *,
    settings: ServerSection = DEFAULT_SETTINGS, chat: ChatFormat | None = None,
) -> FastAPI:
    """`chat` renders messages into prompts and parses chat output; without it, /v1/chat/completions
    and /tokenize with messages answer 400."""
    app = FastAPI(title="ds4serve", version=VERSION)
    # tokenizing and chat rendering run here, off the event loop: a huge prompt delays only itself
    preparing = ThreadPoolExecutor(max_workers=PREPARE_WORKERS, thread_name_prefix="ds4serve-prepare")
    app.router.on_shutdown.append(lambda: preparing.shutdown(wait=False, cancel_futures=True))

    async def off_loop(work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(preparing, partial(work, *args))

    lifecycle = Lifecycle(model.max_num_seqs, settings.max_waiting, settings.drain_timeout_s)
    app.state.lifecycle = lifecycle
    install_error_handlers(app)
    generation = (404, 429, 503)  # an unknown model; the queue is full; the engine is down or draining
    describe_error_statuses(app, {
        "/health": (503,), "/ready": (503,), "/v1/completions": generation, "/v1/chat/completions": generation,
        "/tokenize": (404,), "/detokenize": (404,),
        "/v1/models/{model_id}": (404,), "/v1/responses": generation, "/v1/responses/{response_id}": (404,),
    }, OPEN_PATHS)
    # added innermost first: the request id wraps everything, so every response carries it
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerKeys, keys=api_keys, open_paths=OPEN_PATHS)
    app.add_middleware(RequestIds)

    @app.on_event("startup")
    async def bind_engine_to_loop() -> None:
        engine.bind_loop(asyncio.get_running_loop())

    def unavailable() -> JSONResponse | None:
        if engine.dead_reason is not None:
            return error_response(503, engine.dead_reason, "service_unavailable")
        if engine.stats is not None and engine.stats.unhealthy is not None:
            return error_response(503, engine.stats.unhealthy, "service_unavailable")
        if lifecycle.draining:
            return error_response(503, "the server is shutting down", "service_unavailable")
        if not engine.ready:
            return error_response(503, "the engine is starting", "service_unavailable")
        return None

    async def check_grammars(requests: Sequence[NewRequest]) -> None:
        """The engine compiles each distinct output constraint first (ClientError: it does not)."""
        for structured in {r.params.structured for r in requests if r.params.structured is not None}:
            await engine.check_grammar(structured)

    def check_model(name: str | None) -> None:
        if name is not None and name not in model.names:
            raise UnknownModel(name, model.name)

    @app.get("/health")
    async def health() -> JSONResponse:
        return unavailable() or JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return unavailable() or JSONResponse({"status": "ready"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=name, root=model.root, max_model_len=model.max_model_len) for name in model.names]
        return ModelList(data=cards)  # every served name, as vLLM lists them; responses report the first

    @app.get("/v1/models/{model_id:path}")  # a served name may hold slashes (org/model)
    async def retrieve_model(model_id: str) -> ModelCard:
        check_model(model_id)  # any served name: its card, as /v1/models lists it
        return ModelCard(id=model_id, root=model.root, max_model_len=model.max_model_len)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest) -> Response:
        check_model(body.model)

        def answer() -> Response:  # a million ids take a while to write too: that also happens off the loop
            result = tokenize(body, tokenizer, model.max_model_len, chat.render if chat is not None else None)
            return Response(orjson.dumps(result.model_dump()), media_type="application/json")

        return await off_loop(answer)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        return detokenize(body, tokenizer)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        response_id, requests = await off_loop(build_requests, body, tokenizer, model.max_model_len,
                                               request.state.request_id, settings.max_prompts_per_request)
        await check_grammars(requests)
        call = engine.call(requests, body.n)  # validates: refuses before anything runs (and before a stream's 200)
        admission = lifecycle.admit(len(requests), "n" if len(requests) == body.n else "prompt")
        if body.stream:
            frames = stream_completion(body, response_id, call, tokenizer, model.name, lifecycle.expired)
            return HeldStream(frames, admission)
        with admission:
            work = create_completion(body, response_id, call, tokenizer, model.name)
            response = await _unless_cut_off(work, request, lifecycle.expired)
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if chat is None:
            raise ClientError("chat is unavailable on this server (no chat format for this model)", "messages")
        call = await off_loop(build_chat_call, body, chat, tokenizer, model.max_model_len, request.state.request_id)
        await check_grammars(call.requests)
        engine_call = engine.call(call.requests, body.n)  # validates: refuses before anything runs (and before a stream's 200)
        admission = lifecycle.admit(len(call.requests))
        if body.stream:
            frames = stream_chat_completion(call, engine_call, chat, tokenizer, model.name, lifecycle.expired)
            return HeldStream(frames, admission)
        with admission:
            work = create_chat_completion(call, engine_call, chat, tokenizer, model.name)
            response = await _unless_cut_off(work, request, lifecycle.expired)
        return JSONResponse(response.model_dump(exclude_none=True))

    # --- the Responses API (server/responses.py): over the chat path, kept in memory unless store=false
    stored = ResponseStore()

    @app.post("/v1/responses", response_model=ResponseObject)
    async def create_response_route(body: ResponsesRequest, request: Request) -> Response:
        check_model(body.model)
        if chat is None:
            raise ClientError("responses are unavailable on this server (no chat format for this model)", "input")
        history = stored.conversation(body.previous_response_id)
        call = await off_loop(build_responses_call, body, history, chat, tokenizer, model.max_model_len,
                              request.state.request_id, model.name)
        with responses_params():
            await check_grammars(call.chat.requests)
            engine_call = engine.call(call.chat.requests)  # validates before anything runs (and before a stream's 200)
        admission = lifecycle.admit(len(call.chat.requests))

        def keep(response: ResponseObject) -> None:
            if body.store:
                stored.keep(response, call.conversation_after(response))

        if body.stream:
            return HeldStream(stream_response(call, engine_call, chat, tokenizer, lifecycle.expired, keep), admission)
        with admission:
            response = await _unless_cut_off(create_response(call, engine_call, chat, tokenizer), request, lifecycle.expired)
        keep(response)
        return JSONResponse(response.dump())

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(response_id: str) -> Response:
        kept = stored.get(response_id)
        if kept is None:
            return error_response(404, f"no stored response {response_id!r}", "not_found_error", "response_id")
        return JSONResponse(kept.response.dump())

    return app
