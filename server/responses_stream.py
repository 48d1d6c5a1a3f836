"""A streamed POST /v1/responses: SSE frames `event: <type>` / `data: {...}`, each event numbered by
`sequence_number`, in the order the openai SDK's `responses.stream()` accumulates:

    response.created, response.in_progress,
    per output item: response.output_item.added, then
        reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done
        message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                   response.content_part.done
        function call: response.function_call_arguments.delta..., response.function_call_arguments.done
    then response.output_item.done; last response.completed (its status "incomplete" when the length
    limit cut the output, as vLLM sends it), or response.failed with the error when the engine
    failed or the drain cut the stream off.

Items come from the chat output parser's deltas (server/chat): an item opens at its first delta and
closes when a delta of another item arrives or the generation ends. No [DONE] follows: the Responses
API has none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import orjson

from server.chat import ChatFormat, Delta, ToolCallDelta
from server.chat_completions import SpecialTokenText
from server.completions import stop_strings
from server.engine_client import EngineCall
from server.incremental_text import IncrementalText
from server.responses import ReasoningTokens, ResponsesCall
from server.responses_protocol import (
    FunctionCallOutput,
    MessageOutput,
    OutputItem,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseObject,
)
from server.streaming import StreamUsage, choice_steps
from server.tokenizer import TextTokenizer


class ResponseEvents:
    """The numbered events of one streamed response, and the output items they build."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None  # the last item, while it still streams
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> bytes:
        return self.event(kind, response=response.dump())

    def feed(self, deltas: list[Delta]) -> list[bytes]:
        frames: list[bytes] = []
        for delta in deltas:
            if delta.tool_call is not None:
                frames += self._tool_call(delta.tool_call)
            elif delta.content:
                frames += self._text(MessageOutput, delta.content)
            elif delta.reasoning_content:
                frames += self._text(ReasoningOutput, delta.reasoning_content)
        return frames

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _open_item(self, item: OutputItem) -> list[bytes]:
        frames = self.close()
        item.status = "in_progress"
        self.items.append(item)
        self._open = item
        return [*frames, self.event("response.output_item.added", output_index=self._index, item=item.model_dump())]

    def _text(self, kind: type[MessageOutput | ReasoningOutput], text: str) -> list[bytes]:
        frames: list[bytes] = []
        item = self._open
        if not isinstance(item, kind):
            item = kind()
            frames += self._open_item(item)
            part = OutputText(text="") if isinstance(item, MessageOutput) else ReasoningText(text="")
            frames.append(self.event("response.content_part.added", item_id=item.id, output_index=self._index,
                                     content_index=0, part=part.model_dump()))
            item.content.append(part)  # type: ignore[arg-type]  (the part matches the item's kind)
        item.content[0].text += text
        if isinstance(item, MessageOutput):
            frames.append(self.event("response.output_text.delta", item_id=item.id, output_index=self._index,
                                     content_index=0, delta=text, logprobs=[]))
        else:
            frames.append(self.event("response.reasoning_text.delta", item_id=item.id, output_index=self._index,
                                     content_index=0, delta=text))
        return frames

    def _tool_call(self, fragment: ToolCallDelta) -> list[bytes]:
        frames: list[bytes] = []
        if fragment.id is not None:  # a call's first fragment carries its id and name
            frames += self._open_item(FunctionCallOutput(call_id=fragment.id, name=fragment.name or "", arguments=""))
        item = self._open
        assert isinstance(item, FunctionCallOutput), "a call's fragments follow its first one"
        if fragment.arguments:
            item.arguments += fragment.arguments
            frames.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self._index, delta=fragment.arguments))
        return frames

    def close(self) -> list[bytes]:
        """The events that finish the open item (none if none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = "completed"
        where = {"item_id": item.id, "output_index": self._index}
        frames = []
        if isinstance(item, FunctionCallOutput):
            frames.append(self.event("response.function_call_arguments.done", **where, arguments=item.arguments))
        else:
            part = item.content[0]
            if isinstance(item, MessageOutput):
                frames.append(self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]))
            else:
                frames.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            frames.append(self.event("response.content_part.done", **where, content_index=0, part=part.model_dump()))
        frames.append(self.event("response.output_item.done", output_index=self._index, item=item.model_dump()))
        return frames


async def stream_response(
    call: ResponsesCall, engine_call: EngineCall, fmt: ChatFormat, tokenizer: TextTokenizer,
    interrupt: asyncio.Event | None = None, keep: Callable[[ResponseObject], None] | None = None,
) -> AsyncIterator[bytes]:
    """The response's events as its tokens arrive; `keep` receives the completed response (the
    store), `interrupt` (the drain timed out) fails it."""
    events = ResponseEvents()
    yield events.lifecycle("response.created", call.response("in_progress"))
    yield events.lifecycle("response.in_progress", call.response("in_progress"))
    texts = [IncrementalText(SpecialTokenText(tokenizer), stop_strings(call.chat.body))]
    parser = fmt.parser_for(call.chat.chat, call.chat.prompt)
    usage = StreamUsage(prompt_tokens=len(call.chat.prompt_token_ids))
    reasoning = ReasoningTokens(call.chat.prompt, tokenizer)
    finish_reason = "stop"
    try:
        async with aclosing(choice_steps(engine_call, texts, usage, 1, interrupt)) as steps:
            async for step in steps:
                reasoning.add(step.output.new_token_ids)
                deltas = parser.feed(step.text) if step.text else []
                if step.finish_reason is not None:
                    deltas += parser.finish()
                    finish_reason = step.finish_reason
                for frame in events.feed(deltas):
                    yield frame
        for frame in events.close():
            yield frame
    except Exception as exc:  # noqa: BLE001 - an engine failure mid-stream is the client's response.failed
        yield events.lifecycle("response.failed", call.response("failed", events.items, error=ResponseError(message=str(exc))))
        return
    response = call.finished(events.items, finish_reason, usage.snapshot(), reasoning.count)
    if keep is not None:
        keep(response)
    yield events.lifecycle("response.completed", response)
