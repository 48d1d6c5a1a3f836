"""POST /v1/completions: prompts in, choices out (legacy OpenAI completions, with vLLM's extras).

The response id is `cmpl-<base>`, where the base is the request's x-request-id (or a fresh uuid); the
engine request ids extend it with a per-call tag, so two calls that reuse an x-request-id never collide
in the engine. `usage.prompt_tokens_details.cached_tokens` reads `num_cached_tokens` from the engine's
outputs (prompt tokens the engine's prefix cache served).

A choice's text is the echoed prompt (echo) then the output, decoded as skip_special_tokens says;
its logprobs' text_offset index that text, streamed or not (server/logprobs.py).
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
from server.incremental_text import Decoder, IncrementalText
from server.logprobs import TextOffsets, legacy_logprobs, prompt_logprobs
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
from server.structured_outputs import read_constraints
from server.tokenizer import TextTokenizer
from server.unsupported_fields import COMPLETIONS, refuse_unsupported

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


class KeepSpecialTokens:
    """Decodes keeping the special tokens' text (skip_special_tokens=false)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def text_decoder(body: SamplingFields, tokenizer: TextTokenizer) -> Decoder:
    return tokenizer if body.skip_special_tokens else KeepSpecialTokens(tokenizer)


def prompt_token_lists(body: CompletionRequest, tokenizer: TextTokenizer, max_prompts: int) -> list[list[int]]:
    """Each prompt's token ids; a list of more than `max_prompts` strings or token lists is refused
    before any is tokenized (each prompt is n engine requests: server/lifecycle.py counts them all).
    A text that cannot fit the context is refused untokenized, unless the prompt is to be truncated."""
    prompt = body.prompt

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, body.add_special_tokens, bounded=body.truncate_prompt_tokens is None)

    if isinstance(prompt, str):
        lists = [encode(prompt)]
    elif not prompt:
        raise ClientError("prompt must not be empty", "prompt")
    elif not isinstance(prompt[0], int) and len(prompt) > max_prompts:
        raise ClientError(
            f"prompt holds {len(prompt)} prompts; this server takes at most {max_prompts} in one request "
            "(server.max_prompts_per_request)", "prompt",
        )
    elif all(isinstance(p, str) for p in prompt):
        lists = [encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        lists = [list(prompt)]
    else:
        lists = [list(p) for p in prompt]
    if any(not ids for ids in lists):
        raise ClientError("prompt must not be empty", "prompt")
    return lists


def truncated(ids: list[int], body: SamplingFields, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens; -1 keeps as many as leave room for the
    output (max_model_len - max_tokens; without max_tokens, room for one token). A k past that room
    could never run: the client's 400, as in vLLM."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    output = body.output_limit or 1
    room = max_model_len - output
    if keep > room or room < 1:
        raise ClientError(
            f"truncate_prompt_tokens: {max(room, 0)} prompt tokens at most fit beside {output} output tokens in "
            f"max_model_len {max_model_len}; asked to keep {keep}", "truncate_prompt_tokens",
        )
    return ids[-(room if keep == -1 else keep):]


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
        prompt_logprobs=body.engine_prompt_logprobs,
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


def choice_logprobs(
    body: CompletionRequest, tokenizer: TextTokenizer, output: TextOffsets, ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    echoed: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None,
) -> CompletionLogprobs:
    """The logprobs of a choice's output tokens `ids` (all of them, or a stream chunk's; `output`
    places them in the text), after the echoed prompt's (its ids and entries) when given."""
    assert body.logprobs is not None, "only asked for with logprobs"
    offsets = output.push(ids)
    if echoed is not None:
        echo_ids, echo_entries = echoed
        offsets = TextOffsets(output.decoder).push(echo_ids) + offsets
        ids, entries = [*echo_ids, *ids], [*echo_entries, *entries]
    return legacy_logprobs(tokenizer, entries, ids, offsets, body.logprobs, body.return_tokens_as_token_ids)


def prompt_entries(output: RequestOutput | Generation, prompt_len: int) -> list[TokenLogprob | None]:
    """The prompt tokens' logprob entries (the first None), as the engine reported them."""
    return list(output.prompt_logprobs or [None] * prompt_len)


def build_requests(
    body: CompletionRequest, tokenizer: TextTokenizer, max_model_len: int, base_id: str,
    max_prompts: int = DEFAULT_SETTINGS.max_prompts_per_request,
) -> tuple[str, list[NewRequest]]:
    """The response id and one engine request per (prompt, n); raises ClientError for a bad prompt,
    more than `max_prompts` of them (`server.max_prompts_per_request`) or a field not supported here."""
    refuse_unsupported(body, COMPLETIONS)
    prompts = [truncated(ids, body, max_model_len) for ids in prompt_token_lists(body, tokenizer, max_prompts)]
    response_id, tag = f"cmpl-{base_id}", uuid.uuid4().hex[:8]
    requests = []
    constraints = read_constraints(body, tokenizer)
    for p, ids in enumerate(prompts):
        params = constraints.applied(sampling_params(body, len(ids), max_model_len))
        requests += [NewRequest(f"{response_id}-{tag}-{p}-{i}", tuple(ids), for_choice(params, i), cache_salt=body.cache_salt)
                     for i in range(body.n)]
    return response_id, requests


async def create_completion(
    body: CompletionRequest, response_id: str, call: EngineCall, tokenizer: TextTokenizer, model_name: str,
) -> CompletionResponse:
    requests = call.requests
    prompts = [r.prompt_token_ids for r in requests[:: body.n]]
    stop, decoder = stop_strings(body), text_decoder(body, tokenizer)
    texts = [IncrementalText(decoder, stop, body.include_stop_str_in_output) if stop else None for _ in requests]
    generations = await collect(call, texts)
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
    prompt_ids, decoder = request.prompt_token_ids, text_decoder(body, tokenizer)
    entries = prompt_entries(generation, len(prompt_ids))
    echoed = decoder.decode(list(prompt_ids)) if body.echo else ""
    text = generation.text if generation.text is not None else decoder.decode(generation.token_ids)
    logprobs = None
    if body.logprobs is not None:
        logprobs = choice_logprobs(body, tokenizer, TextOffsets(decoder, len(echoed)), generation.token_ids,
                                   generation.logprobs, (prompt_ids, entries) if body.echo else None)
    return CompletionChoice(
        index=index,
        text=echoed + text,
        logprobs=logprobs,
        finish_reason=generation.finish_reason,
        token_ids=generation.token_ids if body.return_token_ids else None,
        prompt_logprobs=None if body.prompt_logprobs is None else prompt_logprobs(
            tokenizer, entries, prompt_ids, body.prompt_logprobs),
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
    stop, decoder = stop_strings(body), text_decoder(body, tokenizer)
    requests = call.requests
    texts = [IncrementalText(decoder, stop, body.include_stop_str_in_output) for _ in requests]
    offsets: dict[int, TextOffsets] = {}  # per choice, from its first step: where its output tokens sit
    usage = StreamUsage(prompt_tokens=sum(len(r.prompt_token_ids) for r in requests[:: body.n]))
    try:
        async with aclosing(choice_steps(call, texts, usage, body.n, interrupt)) as steps:
            async for step in steps:
                prompt_ids, output = requests[step.index].prompt_token_ids, step.output
                echoes = body.echo and step.first  # the choice's first chunk starts with the prompt
                echoed = decoder.decode(list(prompt_ids)) if echoes else ""
                logprobs = None
                if body.logprobs is not None:
                    if step.first:
                        offsets[step.index] = TextOffsets(decoder, len(echoed))
                    echo = (prompt_ids, prompt_entries(output, len(prompt_ids))) if echoes else None
                    logprobs = choice_logprobs(body, tokenizer, offsets[step.index], output.new_token_ids,
                                               output.new_logprobs, echo)
                choice = CompletionChoice(
                    index=step.index,
                    text=echoed + step.text,
                    logprobs=logprobs,
                    finish_reason=step.finish_reason,
                    token_ids=list(output.new_token_ids) if body.return_token_ids else None,
                    prompt_token_ids=prompt_ids if body.return_token_ids and step.first else None,
                )
                chunk = CompletionChunk(id=response_id, model=model_name, choices=[choice],
                                        usage=usage.snapshot() if options and options.continuous_usage_stats else None)
                yield sse(chunk.model_dump(exclude_none=True))
        if options and options.include_usage:
            yield sse(CompletionChunk(id=response_id, model=model_name, choices=[], usage=usage.snapshot()).model_dump())
    except Exception as exc:  # noqa: BLE001 - an engine failure mid-stream is the client's error frame
        yield error_frame(exc)
    yield DONE
