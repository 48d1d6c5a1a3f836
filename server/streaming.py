"""What every streamed endpoint shares: SSE framing, usage so far, and the merged per-choice steps.

`choice_steps` reads one engine call (a request per choice) and yields their outputs as they arrive, each with
its new text (cut at a stop string, held back inside a UTF-8 character); the endpoint only turns
steps into its own chunk shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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


async def choice_steps(
    call: EngineCall, texts: list[IncrementalText], usage: StreamUsage, choices_per_prompt: int,
    interrupt: asyncio.Event | None = None,
) -> AsyncIterator[ChoiceStep]:
    """Steps of every choice of `call` until all have finished, read from the call's one queue. A
    choice that reaches a stop string ends there and its engine request is aborted. Raises
    RequestFailed (the engine failed a request), the engine client's exception, or ServerShuttingDown
    once `interrupt` is set (the drain timed out); the engine requests still open are then aborted."""

    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        call.interrupt(ServerShuttingDown("the server is shutting down; the request was cut off"))

    watcher = asyncio.create_task(watch(interrupt)) if interrupt is not None else None
    started: set[int] = set()
    try:
        async for index, item in call:
            usage.add(index // choices_per_prompt, item)
            if item.error:
                raise RequestFailed(item.error)
            text, stopped = texts[index].push(item.new_token_ids, item.finished), texts[index].stopped
            if stopped:
                call.stop(index)
            finish_reason = "stop" if stopped else item.finish_reason if item.finished else None
            yield ChoiceStep(index, item, text, finish_reason, index not in started)
            started.add(index)
    finally:
        call.close()
        if watcher is not None:
            watcher.cancel()
