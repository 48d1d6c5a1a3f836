"""POST /v1/completions: prompts in, choices out (legacy OpenAI completions, with vLLM's extras).

The response id is `cmpl-<base>`, where the base is the request's x-request-id (or a fresh uuid); the
engine request ids extend it with a per-call tag, so two calls that reuse an x-request-id never collide
in the engine. `usage.prompt_tokens_details.cached_tokens` reads `num_cached_tokens` from the engine's
outputs (prompt tokens the engine's prefix cache served).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from contract import NewRequest, RequestOutput, SamplingParams, TokenLogprob
from contract.config import ServerSection
from server.engine_client import EngineCall
from server.incremental_text import IncrementalText
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
)
from server.request_errors import ClientError, RequestFailed
from server.streaming import DONE, StreamUsage, cached_tokens, choice_steps, error_frame, sse
from server.tokenizer import TextTokenizer

DEFAULT_SETTINGS = ServerSection()


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


def prompt_token_lists(body: CompletionRequest, tokenizer: TextTokenizer, max_prompts: int) -> list[list[int]]:
    """Each prompt's token ids; a list of more than `max_prompts` strings or token lists is refused
    before any is tokenized (each prompt is n engine requests: server/lifecycle.py counts them all)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        lists = [tokenizer.encode(prompt)]
    elif not prompt:
        raise ClientError("prompt must not be empty", "prompt")
    elif not isinstance(prompt[0], int) and len(prompt) > max_prompts:
        raise ClientError(
            f"prompt holds {len(prompt)} prompts; this server takes at most {max_prompts} in one request "
            "(server.max_prompts_per_request)", "prompt",
        )
    elif all(isinstance(p, str) for p in prompt):
        lists = [tokenizer.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        lists = [list(prompt)]
    else:
        lists = [list(p) for p in prompt]
    if any(not ids for ids in lists):
        raise ClientError("prompt must not be empty", "prompt")
    return lists


def stop_strings(body: SamplingFields) -> tuple[str, ...]:
    """The request's stop strings; empty ones are dropped (they would match before any text)."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return tuple(s for s in stop if s)


def _logit_bias(body: SamplingFields) -> tuple[tuple[int, float], ...]:
    try:
        return tuple({int(key): bias for key, bias in (body.logit_bias or {}).items()}.items())
    except ValueError:
        raise ClientError("logit_bias: keys must be token ids", "logit_bias") from None


def sampling_params(body: SamplingFields, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The body's sampling params for a prompt of `prompt_len` tokens, built once per prompt and
    shared by its choices (`for_choice`); what a schema cannot check (ids against the vocabulary,
    min_tokens) is checked once with the rest of the request, when the engine call is made."""
    limit = body.output_limit
    max_tokens = limit if limit is not None else max(1, max_model_len - prompt_len)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=body.sample_logprobs,
        prompt_logprobs=body.prompt_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body),
        min_tokens=body.min_tokens,
    )


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: a seeded request's choices draw from seeds seed, seed + 1, ... (vLLM's n)."""
    return params if params.seed is None or index == 0 else replace(params, seed=params.seed + index)


async def collect(call: EngineCall, texts: Sequence[IncrementalText | None]) -> list[Generation]:
    """Every request's outputs of `call`, from its one queue; a request with a text (stop strings)
    ends at its first stop string, and its engine request is aborted there, so it stops using the
    engine."""
    generations = [Generation() for _ in call.requests]
    try:
        async for index, output in call:
            generation, text = generations[index], texts[index]
            _absorb(generation, output)
            if text is not None:
                text.push(output.new_token_ids, output.finished)
                if text.stopped:
                    generation.text, generation.finish_reason = text.sent, "stop"
                    call.stop(index)
    finally:
        call.close()
    return generations


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
    body: CompletionRequest, tokenizer: TextTokenizer, max_model_len: int, base_id: str,
    max_prompts: int = DEFAULT_SETTINGS.max_prompts_per_request,
) -> tuple[str, list[NewRequest]]:
    """The response id and one engine request per (prompt, n); raises ClientError for a bad prompt or
    more than `max_prompts` of them (`server.max_prompts_per_request`)."""
    prompts = prompt_token_lists(body, tokenizer, max_prompts)
    response_id, tag = f"cmpl-{base_id}", uuid.uuid4().hex[:8]
    requests = []
    for p, ids in enumerate(prompts):
        params = sampling_params(body, len(ids), max_model_len)
        requests += [NewRequest(f"{response_id}-{tag}-{p}-{i}", tuple(ids), for_choice(params, i), cache_salt=body.cache_salt)
                     for i in range(body.n)]
    return response_id, requests


async def create_completion(
    body: CompletionRequest, response_id: str, call: EngineCall, tokenizer: TextTokenizer, model_name: str,
) -> CompletionResponse:
    requests = call.requests
    prompts = [r.prompt_token_ids for r in requests[:: body.n]]
    stop = stop_strings(body)
    generations = await collect(call, [IncrementalText(tokenizer, stop) if stop else None for _ in requests])
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
    body: CompletionRequest, tokenizer: TextTokenizer, index: int, request: NewRequest, generation: Generation
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
            ids = [*prompt_ids, *ids]
        logprobs = legacy_logprobs(tokenizer, entries, ids)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=generation.finish_reason,
        token_ids=generation.token_ids if body.return_token_ids else None,
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
    )

async def stream_completion(
    body: CompletionRequest, response_id: str, call: EngineCall, tokenizer: TextTokenizer, model_name: str,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[bytes]:
    """SSE frames for every choice as its tokens arrive, a usage frame if asked, then [DONE]. A choice
    that reaches a stop string ends there (finish_reason "stop"). An engine failure mid-stream, or
    `interrupt` being set (the server's drain timed out), becomes an error frame before [DONE]."""
    options = body.stream_options
    stop = stop_strings(body)
    requests = call.requests
    texts = [IncrementalText(tokenizer, stop) for _ in requests]
    usage = StreamUsage(prompt_tokens=sum(len(r.prompt_token_ids) for r in requests[:: body.n]))
    try:
        async with aclosing(choice_steps(call, texts, usage, body.n, interrupt)) as steps:
            async for step in steps:
                choice = CompletionChoice(
                    index=step.index,
                    text=step.text,
                    finish_reason=step.finish_reason,
                    token_ids=list(step.output.new_token_ids) if body.return_token_ids else None,
                    prompt_token_ids=requests[step.index].prompt_token_ids if body.return_token_ids and step.first else None,
                )
                chunk = CompletionChunk(id=response_id, model=model_name, choices=[choice],
                                        usage=usage.snapshot() if options and options.continuous_usage_stats else None)
                yield sse(chunk.model_dump(exclude_none=True))
        if options and options.include_usage:
            yield sse(CompletionChunk(id=response_id, model=model_name, choices=[], usage=usage.snapshot()).model_dump())
    except Exception as exc:  # noqa: BLE001 - an engine failure mid-stream is the client's error frame
        yield error_frame(exc)
    yield DONE
