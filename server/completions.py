"""POST /v1/completions: prompts in, choices out (legacy OpenAI completions, with vLLM's extras).

The response id is `cmpl-<base>`, where the base is the request's x-request-id (or a fresh uuid); the
engine request ids extend it with a per-call tag, so two calls that reuse an x-request-id never collide
in the engine. `usage.prompt_tokens_details.cached_tokens` reads `num_cached_tokens` from the engine's
outputs where they carry it (0 until the prefix cache reports it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import orjson

from scheduler.request import InvalidSamplingParams, Request, RequestOutput, SamplingParams, TokenLogprob
from server.engine_client import EngineClient
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
    error_body,
)
from server.tokenizer import TextTokenizer


class ClientError(ValueError):
    """A request the client must fix; becomes HTTP 400 with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Generation:
    """Everything one choice accumulated from the engine."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None  # the output text cut before a stop string; None: decode token_ids
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


class RequestFailed(RuntimeError):
    """The engine ended a request with an error (HTTP 500); the server goes on."""


class ServerShuttingDown(RuntimeError):
    """The drain timeout passed with this request still running (HTTP 503)."""


def cached_tokens(output: RequestOutput) -> int:
    return getattr(output, "num_cached_tokens", 0)


def prompt_token_lists(body: CompletionRequest, tokenizer: TextTokenizer) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        lists = [tokenizer.encode(prompt)]
    elif not prompt:
        raise ClientError("prompt must not be empty", "prompt")
    elif all(isinstance(p, str) for p in prompt):
        lists = [tokenizer.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        lists = [list(prompt)]
    else:
        lists = [list(p) for p in prompt]
    if any(not ids for ids in lists):
        raise ClientError("prompt must not be empty", "prompt")
    return lists


def stop_strings(body: CompletionRequest) -> tuple[str, ...]:
    """The request's stop strings; empty ones are dropped (they would match before any text)."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return tuple(s for s in stop if s)


def _logit_bias(body: CompletionRequest) -> tuple[tuple[int, float], ...]:
    try:
        return tuple({int(key): bias for key, bias in (body.logit_bias or {}).items()}.items())
    except ValueError:
        raise ClientError("logit_bias: keys must be token ids", "logit_bias") from None


def sampling_params(
    body: CompletionRequest, prompt_len: int, max_model_len: int, vocab_size: int, index: int
) -> SamplingParams:
    """Raises ClientError for parameters the engine would not run (ids outside the vocabulary...)."""
    limit = body.output_limit
    max_tokens = limit if limit is not None else max(1, max_model_len - prompt_len)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=None if body.seed is None else body.seed + index,
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body),
        min_tokens=body.min_tokens,
    )
    try:
        params.validate(vocab_size)
    except InvalidSamplingParams as exc:
        raise ClientError(str(exc), exc.param) from None
    return params


async def collect(engine: EngineClient, request: Request, text: IncrementalText | None = None) -> Generation:
    """The request's outputs; given `text` (stop strings), ends at the first stop string and aborts the
    engine request there, so it stops using the engine."""
    generation = Generation()
    async with aclosing(engine.generate(request)) as outputs:
        async for output in outputs:
            _absorb(generation, output)
            if text is not None:
                text.push(output.new_token_ids, output.finished)
                if text.stopped:
                    generation.text, generation.finish_reason = text.sent, "stop"
                    break  # closing generate() before its last output aborts the request
    return generation


def _absorb(generation: Generation, output: RequestOutput) -> None:
    generation.token_ids.extend(output.new_token_ids)
    generation.logprobs.extend(output.new_logprobs)
    if output.prompt_logprobs is not None:
        generation.prompt_logprobs = output.prompt_logprobs
    generation.cached_tokens = max(generation.cached_tokens, cached_tokens(output))
    if output.finished:
        generation.finish_reason, generation.error = output.finish_reason, output.error


def legacy_logprobs(
    tokenizer: TextTokenizer, entries: list[TokenLogprob | None], token_ids: list[int]
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = tokenizer.token_text(token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        result.token_logprobs.append(None if entry is None else entry.logprob)
        top = None
        if entry is not None:
            top = {tokenizer.token_text(t): lp for t, lp in entry.top} or {text: entry.logprob}
        result.top_logprobs.append(top)
    return result


def build_requests(
    body: CompletionRequest, tokenizer: TextTokenizer, max_model_len: int, base_id: str
) -> tuple[str, list[Request]]:
    """The response id and one engine request per (prompt, n); raises ClientError for a bad prompt."""
    prompts = prompt_token_lists(body, tokenizer)
    response_id, tag = f"cmpl-{base_id}", uuid.uuid4().hex[:8]
    requests = [
        Request(f"{response_id}-{tag}-{p}-{i}", ids, sampling_params(body, len(ids), max_model_len, tokenizer.vocab_size, i))
        for p, ids in enumerate(prompts)
        for i in range(body.n)
    ]
    return response_id, requests


async def create_completion(
    body: CompletionRequest, response_id: str, requests: list[Request], engine: EngineClient,
    tokenizer: TextTokenizer, model_name: str,
) -> CompletionResponse:
    prompts = [r.prompt_token_ids for r in requests[:: body.n]]
    stop = stop_strings(body)
    generations = await asyncio.gather(
        *(collect(engine, r, IncrementalText(tokenizer, stop) if stop else None) for r in requests)
    )
    failed = next((g.error for g in generations if g.error), None)
    if failed:
        raise RequestFailed(failed)
    choices = []
    for index, (request, generation) in enumerate(zip(requests, generations)):
        choices.append(_choice(body, tokenizer, index, request, generation))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[:: body.n])
    completion_tokens = sum(len(g.token_ids) for g in generations)
    cached = sum(g.cached_tokens for g in generations[:: body.n])
    return CompletionResponse(
        id=response_id,
        model=model_name,
        choices=choices,
        usage=Usage.of(prompt_tokens, completion_tokens, cached),
        prompt_token_ids=(prompts[0] if len(prompts) == 1 else prompts) if body.return_token_ids else None,
    )


def _choice(
    body: CompletionRequest, tokenizer: TextTokenizer, index: int, request: Request, generation: Generation
) -> CompletionChoice:
    prompt_ids = request.prompt_token_ids
    text = generation.text if generation.text is not None else tokenizer.decode(generation.token_ids)
    if body.echo:
        text = tokenizer.decode(prompt_ids) + text
    logprobs = None
    if body.logprobs is not None:
        entries: list[TokenLogprob | None] = list(generation.logprobs)
        ids = list(generation.token_ids)
        if body.echo:
            entries = list(generation.prompt_logprobs or [None] * len(prompt_ids)) + entries
            ids = prompt_ids + ids
        logprobs = legacy_logprobs(tokenizer, entries, ids)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=generation.finish_reason,
        token_ids=generation.token_ids if body.return_token_ids else None,
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
    )


def _first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=None)


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class IncrementalText:
    """Text deltas of a growing token list. A delta never ends inside a UTF-8 character (a decode that
    ends in U+FFFD is held back until the next token completes it) nor in text that could be the start
    of a stop string (held back until it is not, or the stream ends). At the first stop string the
    text ends just before it and `stopped` is set: nothing past a stop string is ever sent."""

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop, self.token_ids, self.sent, self.stopped = tokenizer, stop, [], "", False

    def push(self, token_ids: tuple[int, ...], final: bool) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        cut = _first_stop(text, self.stop)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - _stop_prefix_len(text, self.stop)]
        delta, self.sent = text[len(self.sent):], text
        return delta


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _error_frame(exc: Exception | str) -> bytes:
    if isinstance(exc, ServerShuttingDown):
        return _sse(error_body(str(exc), 503, "service_unavailable"))
    return _sse(error_body(str(exc), 500, "internal_server_error"))


@dataclass
class StreamUsage:
    """Token counts of a streamed response so far (prompts counted once, not once per choice)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> cached prompt tokens

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.completion_tokens += len(output.new_token_ids)
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), cached_tokens(output))

    def snapshot(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens, sum(self.cached.values()))


async def stream_completion(
    body: CompletionRequest, response_id: str, requests: list[Request], engine: EngineClient,
    tokenizer: TextTokenizer, model_name: str, interrupt: asyncio.Event | None = None,
) -> AsyncIterator[bytes]:
    """SSE frames for every choice as its tokens arrive, a usage frame if asked, then [DONE].
    A choice that reaches a stop string ends there (finish_reason "stop") and its engine request is
    aborted. An engine failure mid-stream, or `interrupt` being set (the server's drain timed out),
    becomes an error frame before [DONE]; the engine requests still open are then aborted."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        try:
            async for output in engine.generate(request):
                await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error frame
            await queue.put((index, exc))

    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        await queue.put((-1, ServerShuttingDown("the server is shutting down; the request was cut off")))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    if interrupt is not None:
        tasks.append(asyncio.create_task(watch(interrupt)))
    options = body.stream_options
    stop = stop_strings(body)
    texts = [IncrementalText(tokenizer, stop) for _ in requests]
    usage = StreamUsage(prompt_tokens=sum(len(r.prompt_token_ids) for r in requests[:: body.n]))
    open_choices, started = set(range(len(requests))), set()
    try:
        while open_choices:
            index, item = await queue.get()
            if isinstance(item, Exception):
                yield _error_frame(item)
                break
            if index not in open_choices:  # what a choice cut at a stop string still had in flight
                continue
            usage.add(index // body.n, item)
            if item.error:
                yield _error_frame(item.error)
                break
            text, stopped = texts[index].push(item.new_token_ids, item.finished), texts[index].stopped
            if stopped:
                tasks[index].cancel()  # leaving generate() before its last output aborts the request
            if stopped or item.finished:
                open_choices.discard(index)
            finish_reason = "stop" if stopped else item.finish_reason if item.finished else None
            choice = CompletionChoice(
                index=index,
                text=text,
                finish_reason=finish_reason,
                token_ids=list(item.new_token_ids) if body.return_token_ids else None,
                prompt_token_ids=requests[index].prompt_token_ids if body.return_token_ids and index not in started else None,
            )
            started.add(index)
            chunk = CompletionChunk(id=response_id, model=model_name, choices=[choice],
                                    usage=usage.snapshot() if options and options.continuous_usage_stats else None)
            yield _sse(chunk.model_dump(exclude_none=True))
        else:
            if options and options.include_usage:
                yield _sse(CompletionChunk(id=response_id, model=model_name, choices=[], usage=usage.snapshot()).model_dump())
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
