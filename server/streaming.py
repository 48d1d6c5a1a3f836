"""What every streamed endpoint shares: SSE framing, usage so far, and the merged per-choice steps.

`choice_steps` reads one engine call (a request per choice) and yields, per hand-over of outputs, one step per
choice with its new tokens and text (cut at a stop string, held back inside a UTF-8 character); the
endpoint only turns steps into its own chunk shape, one SSE frame each.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from contract import RequestOutput
from server.engine_client import EngineCall, EngineDeadError
from server.incremental_text import IncrementalText
from server.protocol import Usage, error_body
from server.request_errors import RequestFailed, ServerShuttingDown

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_frame(exc: Exception) -> bytes:
    """A stream's last frame before [DONE]: 503 for what is transient (shutdown, a dead engine), else 500."""
    if isinstance(exc, (ServerShuttingDown, EngineDeadError)):
        return sse(error_body(str(exc), 503, "service_unavailable"))
    return sse(error_body(str(exc), 500, "internal_server_error"))


def cached_tokens(output: RequestOutput) -> int:
    return output.num_cached_tokens


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


@dataclass(frozen=True)
class ChoiceStep:
    index: int  # the choice (the position of its request)
    output: RequestOutput
    text: str  # the new text
    finish_reason: str | None  # set on the choice's last step ("stop" when cut at a stop string)
    first: bool  # the choice's first step


def merged(earlier: ChoiceStep, later: ChoiceStep) -> ChoiceStep:
    """Two consecutive steps of one choice as one: the later's output with both steps' tokens, logprobs
    and text, the earlier's prompt logprobs and queue time (they come on a request's first output)."""
    a, b = earlier.output, later.output
    output = replace(
        b, new_token_ids=a.new_token_ids + b.new_token_ids, new_logprobs=a.new_logprobs + b.new_logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        queue_time_s=a.queue_time_s if a.queue_time_s is not None else b.queue_time_s,
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens))
    return ChoiceStep(later.index, output, earlier.text + later.text, later.finish_reason, earlier.first)


async def choice_steps(
    call: EngineCall, texts: list[IncrementalText], usage: StreamUsage, choices_per_prompt: int,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[ChoiceStep]:
    """Steps of every choice of `call` until all have finished, read from the call's one queue: per
    hand-over (what arrived while the stream was busy, one engine step when it keeps up) one step per
    choice with all its new tokens, so a stream that falls behind frames less often instead of falling
    further behind (vLLM's output collector merges the same way). A choice that reaches a stop string
    ends there and its engine request is aborted (outputs that came after it in the same hand-over
    are dropped, as they would be one at a time). Raises RequestFailed (the engine failed a request),
    the engine client's exception, or ServerShuttingDown once `interrupt` is set (the drain timed out),
    after sending what was read before; the engine requests still open are then aborted."""

    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        call.interrupt(ServerShuttingDown("the server is shutting down; the request was cut off"))

    watcher = asyncio.create_task(watch(interrupt)) if interrupt is not None else None
    started: set[int] = set()
    held: dict[int, ChoiceStep] = {}  # per choice, what was read since the last hand-over, merged
    try:
        async for entry in call.hand_overs():
            if entry is None:  # nothing more has arrived: one step per choice for all it read
                for step in held.values():
                    yield step
                held.clear()
                continue
            index, item = entry
            usage.add(index // choices_per_prompt, item)
            if item.error:
                for step in held.values():  # what came before the failure is still sent
                    yield step
                raise RequestFailed(item.error)
            text, stopped = texts[index].push(item.new_token_ids, item.finished), texts[index].stopped
            if stopped:
                call.stop(index)
            finish_reason = "stop" if stopped else item.finish_reason if item.finished else None
            step = ChoiceStep(index, item, text, finish_reason, index not in started)
            held[index] = merged(held[index], step) if index in held else step
            started.add(index)
        for step in held.values():  # every choice finished (the last outputs came together)
            yield step
    finally:
        call.close()
        if watcher is not None:
            watcher.cancel()
