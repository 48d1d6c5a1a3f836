"""POST /v1/chat/completions: messages rendered by the checkpoint's chat format, choices parsed back
into reasoning, content and tool calls (server/chat), over the same engine requests, stop strings,
usage and SSE framing as /v1/completions.

The text the parser reads keeps special tokens: <think>, </think> and the DSML markup are the
structure it parses. Each choice's message carries `reasoning` beside `reasoning_content` (the same
text), since vLLM-era clients read either name.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from contract import NewRequest, TokenLogprob
from server.chat import ChatFormat, Delta, OutputParser, ParsedMessage
from server.chat.grammar import reasoning_open
from server.chat.request import ChatRequest
from server.chat.tokens import THINK_START
from server.chat_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    TokenLogprobEntry,
    TopLogprob,
)
from server.completions import (
    Generation,
    collect,
    for_choice,
    prompt_entries,
    sampling_params,
    stop_strings,
    truncated,
)
from server.engine_client import EngineCall
from server.incremental_text import IncrementalText
from server.logprobs import floored, prompt_logprobs, token_label
from server.protocol import Usage
from server.request_errors import RequestFailed
from server.streaming import DONE, ChoiceStep, StreamUsage, choice_steps, error_frame, sse
from server.structured_outputs import read_constraints, tool_call_constraint
from server.tokenizer import TextTokenizer
from server.unsupported_fields import BUILT_IN_CHAT, CHAT, refuse_unsupported


class SpecialTokenText:
    """Decodes keeping special tokens, which the chat output parser reads as structure."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class ChatCall:
    """One chat request made ready for the engine: one engine request per choice (n)."""

    response_id: str
    body: ChatCompletionRequest
    raw: dict[str, Any]  # the body as server/chat reads it
    chat: ChatRequest  # the body read once: rendering and every choice's output parser use it
    prompt: str  # the rendered prompt text, BOS included
    requests: list[NewRequest]

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.requests[0].prompt_token_ids


def build_chat_call(
    body: ChatCompletionRequest, fmt: ChatFormat, tokenizer: TextTokenizer, max_model_len: int, base_id: str
) -> ChatCall:
    """Raises ChatRequestError or ClientError (both 400) for what the client must fix."""
    refuse_unsupported(body, CHAT)
    if fmt.template is None:  # the built-in encoder (a checkpoint's own template reads these itself)
        refuse_unsupported(body, BUILT_IN_CHAT)
    raw = body.model_dump(exclude_none=True)
    chat = fmt.read(raw)  # with the server's default chat_template_kwargs
    prompt = fmt.render_request(chat, raw)
    # the rendered prompt holds its BOS (add_special_tokens adds another, as in vLLM)
    ids = tokenizer.encode(prompt, body.add_special_tokens, bounded=body.truncate_prompt_tokens is None, param="messages")
    ids = truncated(ids, body, max_model_len)
    response_id, tag = f"chatcmpl-{base_id}", uuid.uuid4().hex[:8]
    forced = tool_call_constraint(chat.tools, chat.tool_choice, chat.tool_name, chat.parallel_tool_calls)
    constraints = read_constraints(body, tokenizer, reasoning=reasoning_open(prompt), tool_call=forced)
    params = constraints.applied(sampling_params(body, len(ids), max_model_len))
    boundary, prompt_ids = history_end(ids, tokenizer), tuple(ids)
    requests = [NewRequest(f"{response_id}-{tag}-{i}", prompt_ids, for_choice(params, i), cache_salt=body.cache_salt,
                           cache_boundary=boundary) for i in range(body.n)]
    return ChatCall(response_id, body, raw, chat, prompt, requests)


def history_end(ids: list[int], tokenizer: TextTokenizer) -> int | None:
    """Where the next turn's prompt will stop matching this one: before an opening `<think>`, since
    the next turn renders this answer as `</think>answer` (earlier reasoning is dropped). The prefix
    cache keeps a state point there, so follow-up turns reuse the whole history before it."""
    if len(ids) > 1 and tokenizer.token_text(ids[-1]) == THINK_START:
        return len(ids) - 1
    return None


def chat_logprobs(tokenizer: TextTokenizer, entries: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_label(tokenizer, token_id, as_ids)
        return TopLogprob(token=text, logprob=floored(logprob), bytes=list(text.encode()))

    return ChatLogprobs(content=[
        TokenLogprobEntry(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries
    ])


def message_of(parsed: ParsedMessage) -> dict[str, Any]:
    message = parsed.to_openai()
    if parsed.reasoning_content is not None:
        message["reasoning"] = parsed.reasoning_content
    return message


async def create_chat_completion(
    call: ChatCall, engine_call: EngineCall, fmt: ChatFormat, tokenizer: TextTokenizer, model_name: str
) -> ChatCompletionResponse:
    decoder, stop = SpecialTokenText(tokenizer), stop_strings(call.body)
    include = call.body.include_stop_str_in_output
    generations = await collect(engine_call, [IncrementalText(decoder, stop, include) if stop else None for _ in call.requests])
    failed = next((g.error for g in generations if g.error), None)
    if failed:
        raise RequestFailed(failed)
    choices = [_choice(call, fmt, tokenizer, i, g) for i, g in enumerate(generations)]
    completion_tokens = sum(len(g.token_ids) for g in generations)
    return ChatCompletionResponse(
        id=call.response_id,
        model=model_name,
        choices=choices,
        usage=Usage.of(len(call.prompt_token_ids), completion_tokens, generations[0].cached_tokens),
        prompt_logprobs=None if call.body.prompt_logprobs is None else prompt_logprobs(
            tokenizer, prompt_entries(generations[0], len(call.prompt_token_ids)), call.prompt_token_ids,
            call.body.prompt_logprobs),
        prompt_token_ids=call.prompt_token_ids if call.body.return_token_ids else None,
    )


def _choice(call: ChatCall, fmt: ChatFormat, tokenizer: TextTokenizer, index: int, generation: Generation) -> ChatChoice:
    assert generation.finish_reason is not None, "collect() returns finished generations"
    text = generation.text if generation.text is not None else SpecialTokenText(tokenizer).decode(generation.token_ids)
    parsed = fmt.parse_for(call.chat, call.prompt, text)
    return ChatChoice(
        index=index,
        message=message_of(parsed),
        logprobs=chat_logprobs(tokenizer, generation.logprobs, call.body.return_tokens_as_token_ids) if call.body.logprobs else None,
        finish_reason=parsed.finish_reason(generation.finish_reason),
        token_ids=generation.token_ids if call.body.return_token_ids else None,
    )


def merge_deltas(deltas: list[Delta]) -> dict[str, Any]:
    """One chunk's `delta` from the parser's deltas of one engine step (fragments of one tool call
    joined); `reasoning` mirrors `reasoning_content`."""
    merged: dict[str, Any] = {}
    for delta in deltas:
        for key, value in delta.to_openai().items():
            if key != "tool_calls":
                merged[key] = merged.get(key, "") + value
                continue
            calls = merged.setdefault("tool_calls", [])
            for fragment in value:
                if calls and calls[-1]["index"] == fragment["index"] and "id" not in fragment:
                    calls[-1]["function"]["arguments"] += fragment["function"]["arguments"]
                else:
                    calls.append(fragment)
    if "reasoning_content" in merged:
        merged["reasoning"] = merged["reasoning_content"]
    return merged


def _chunk_choice(
    step: ChoiceStep, parser: OutputParser, body: ChatCompletionRequest, tokenizer: TextTokenizer
) -> ChatChunkChoice | None:
    """The step's chunk, or None when it has nothing to tell (text held back, no logprobs asked)."""
    deltas = parser.feed(step.text) if step.text else []
    finish_reason = None
    if step.finish_reason is not None:
        deltas += parser.finish()
        finish_reason = parser.message().finish_reason(step.finish_reason)
    delta = merge_deltas(deltas)
    logprobs = chat_logprobs(tokenizer, list(step.output.new_logprobs), body.return_tokens_as_token_ids) if body.logprobs else None
    token_ids = list(step.output.new_token_ids) if body.return_token_ids else None
    if not delta and finish_reason is None and logprobs is None and token_ids is None:
        return None
    return ChatChunkChoice(index=step.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, token_ids=token_ids)


async def stream_chat_completion(
    call: ChatCall, engine_call: EngineCall, fmt: ChatFormat, tokenizer: TextTokenizer, model_name: str,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[bytes]:
    """A role chunk per choice, then each choice's deltas as its tokens arrive (finish_reason on its
    last chunk), a usage chunk if asked, then [DONE]; an engine failure or `interrupt` (the drain
    timed out) becomes an error frame before [DONE]."""
    body, options = call.body, call.body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    stop = stop_strings(body)
    texts = [IncrementalText(SpecialTokenText(tokenizer), stop, body.include_stop_str_in_output) for _ in call.requests]
    parsers = [fmt.parser_for(call.chat, call.prompt) for _ in call.requests]
    usage = StreamUsage(prompt_tokens=len(call.prompt_token_ids))

    def frame(choices: list[ChatChunkChoice], with_usage: bool, prompt_ids: list[int] | None = None) -> bytes:
        chunk = ChatCompletionChunk(id=call.response_id, model=model_name, choices=choices,
                                    usage=usage.snapshot() if with_usage else None, prompt_token_ids=prompt_ids)
        return sse(chunk.model_dump(exclude_none=True))

    try:
        for index in range(len(call.requests)):
            role = ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})
            first = index == 0 and body.return_token_ids
            yield frame([role], continuous, call.prompt_token_ids if first else None)
        async with aclosing(choice_steps(engine_call, texts, usage, body.n, interrupt)) as steps:
            async for step in steps:
                choice = _chunk_choice(step, parsers[step.index], body, tokenizer)
                if choice is not None:
                    yield frame([choice], continuous)
        if options is not None and options.include_usage:
            yield frame([], True)
    except Exception as exc:  # noqa: BLE001 - an engine failure mid-stream is the client's error frame
        yield error_frame(exc)
    yield DONE
