"""POST /v1/completions: prompts in, choices out (legacy OpenAI completions, with vLLM's extras)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from scheduler.request import Request, RequestOutput, SamplingParams, TokenLogprob
from server.engine_client import EngineClient
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
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


def sampling_params(body: CompletionRequest, prompt_len: int, max_model_len: int, index: int) -> SamplingParams:
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, max_model_len - prompt_len)
    return SamplingParams(
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
    )


async def collect(engine: EngineClient, request: Request) -> Generation:
    generation = Generation()
    async for output in engine.generate(request):
        _absorb(generation, output)
    return generation


def _absorb(generation: Generation, output: RequestOutput) -> None:
    generation.token_ids.extend(output.new_token_ids)
    generation.logprobs.extend(output.new_logprobs)
    if output.prompt_logprobs is not None:
        generation.prompt_logprobs = output.prompt_logprobs
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


def build_requests(body: CompletionRequest, tokenizer: TextTokenizer, max_model_len: int) -> tuple[str, list[Request]]:
    """One engine request per (prompt, n); raises ClientError for a bad prompt."""
    prompts = prompt_token_lists(body, tokenizer)
    base_id = uuid.uuid4().hex
    requests = [
        Request(f"cmpl-{base_id}-{p}-{i}", ids, sampling_params(body, len(ids), max_model_len, i))
        for p, ids in enumerate(prompts)
        for i in range(body.n)
    ]
    return f"cmpl-{base_id}", requests


async def create_completion(
    body: CompletionRequest, response_id: str, requests: list[Request], engine: EngineClient,
    tokenizer: TextTokenizer, model_name: str,
) -> CompletionResponse:
    prompts = [r.prompt_token_ids for r in requests[:: body.n]]
    generations = await asyncio.gather(*(collect(engine, r) for r in requests))
    failed = next((g.error for g in generations if g.error), None)
    if failed:
        raise RuntimeError(failed)
    choices = []
    for index, (request, generation) in enumerate(zip(requests, generations)):
        choices.append(_choice(body, tokenizer, index, request, generation))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[:: body.n])
    completion_tokens = sum(len(g.token_ids) for g in generations)
    return CompletionResponse(
        id=response_id,
        model=model_name,
        choices=choices,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens),
        prompt_token_ids=(prompts[0] if len(prompts) == 1 else prompts) if body.return_token_ids else None,
    )


def _choice(
    body: CompletionRequest, tokenizer: TextTokenizer, index: int, request: Request, generation: Generation
) -> CompletionChoice:
    prompt_ids = request.prompt_token_ids
    text = tokenizer.decode(generation.token_ids)
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


class IncrementalText:
    """Text deltas of a growing token list that never end inside a UTF-8 character: a decode that ends
    in U+FFFD is held back until the next token completes it (or the stream ends)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer, self.token_ids, self.sent = tokenizer, [], ""

    def push(self, token_ids: tuple[int, ...], final: bool) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def stream_completion(
    body: CompletionRequest, response_id: str, requests: list[Request], engine: EngineClient,
    tokenizer: TextTokenizer, model_name: str,
) -> AsyncIterator[bytes]:
    """SSE frames for every choice as its tokens arrive, a usage frame if asked, then [DONE].
    An engine failure mid-stream becomes an error frame before [DONE]."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        try:
            async for output in engine.generate(request):
                await queue.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - reported to the client as an error frame
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    texts = [IncrementalText(tokenizer) for _ in requests]
    completion_tokens, open_choices = 0, len(requests)
    try:
        while open_choices:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                yield _sse({"error": {"message": str(item), "type": "internal_server_error", "code": 500}})
                break
            completion_tokens += len(item.new_token_ids)
            open_choices -= item.finished
            if item.error:
                yield _sse({"error": {"message": item.error, "type": "internal_server_error", "code": 500}})
                break
            choice = CompletionChoice(
                index=index,
                text=texts[index].push(item.new_token_ids, item.finished),
                finish_reason=item.finish_reason if item.finished else None,
                token_ids=list(item.new_token_ids) if body.return_token_ids else None,
            )
            chunk = CompletionChunk(id=response_id, model=model_name, choices=[choice])
            yield _sse(chunk.model_dump(exclude_none=True))
        else:
            if body.stream_options and body.stream_options.include_usage:
                prompt_tokens = sum(len(r.prompt_token_ids) for r in requests[:: body.n])
                usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=prompt_tokens + completion_tokens)
                yield _sse(CompletionChunk(id=response_id, model=model_name, choices=[], usage=usage).model_dump())
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
