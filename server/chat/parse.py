"""Incremental parsing of generated text into reasoning, content and DSML tool calls.

One `OutputParser` per request: `feed(text_delta)` returns stream deltas, `finish()` the last
ones, `message()` the final assistant message. Both follow vLLM 0.33.0's `deepseek_v4` /
`deepseek_v41` parsers: the stream is one pass of the grammar (grammar.py), the final message
is vLLM's non-streaming parse of the whole text (reasoning split first, then tool calls).
The two differ only where vLLM's do: a call cut off by the end of the generation streams the
JSON prefix that was stable, while the message re-parses it (a parameter without its closing
tag is left out); a <think> block after a tool call is reasoning only in the message.

Where vLLM's stream depends on how the text was chunked, this parser takes one
chunk-independent behaviour, so every split of a text streams the same result: trailing
reasoning whitespace is held back and dropped at the end; leading whitespace-only content is
held back and dropped once a tool call starts; arguments are re-converted after each `>`.

Tool-call ids are `chatcmpl-tool-` plus 32 random hex digits (vLLM's random ids); a call's
stream index is its position in the output, as in vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.chat.arguments import ArgumentConverter
from server.chat.dialects import Dialect
from server.chat.engine import Call, CallPolicy, StreamEngine, new_call_id
from server.chat.grammar import State
from server.chat.output import Delta, ParsedMessage, ToolCall
from server.chat.split import split_reasoning


class OutputParser:
    """Parses one generation. `tools` are the request's tools (OpenAI shape, possibly empty)."""

    def __init__(
        self,
        dialect: Dialect | None,
        *,
        reasoning_open: bool,
        tools: list[dict[str, Any]],
        tool_choice: str = "auto",
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ) -> None:
        self._dialect = dialect
        self._reasoning_open = reasoning_open and dialect is not None
        self._args = ArgumentConverter(dialect, tools) if dialect else None
        # tool_choice "none" drops the calls block unread; without tools in the request it is
        # parsed (so it leaves the content) but never returned.
        suppressed = bool(tools) and tool_choice == "none"
        self._policy = CallPolicy(
            parse=not suppressed,
            stream=bool(tools) and not suppressed,
            first_only=not parallel_tool_calls,
        )
        start = State.REASONING if self._reasoning_open else State.CONTENT
        self._stream = StreamEngine(dialect, self._args, self._policy, state=start)
        self._include_reasoning = include_reasoning
        self._text: list[str] = []
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        assert not self._finished, "feed() after finish()"
        self._text.append(text)
        return self._visible(self._stream.feed(text))

    def finish(self) -> list[Delta]:
        assert not self._finished, "finish() twice"
        self._finished = True
        return self._visible(self._stream.finish())

    def message(self) -> ParsedMessage:
        """The final message of the whole generation (after `finish`)."""
        assert self._finished, "message() before finish()"
        text = "".join(self._text)
        reasoning, content = split_reasoning(text, self._dialect, self._reasoning_open)
        tool_pass = StreamEngine(
            self._dialect, self._args, replace(self._policy, stream=False), state=State.CONTENT
        )
        tool_pass.feed(content)
        tool_pass.finish()
        calls = [self._final_call(i, c) for i, c in enumerate(tool_pass.calls) if c.name.strip()]
        calls = calls[:1] if self._policy.first_only else calls
        answer = "".join(tool_pass.content)
        return ParsedMessage(
            reasoning_content=(reasoning or None) if self._include_reasoning else None,
            content=None if calls and not answer.strip() else answer or None,
            tool_calls=tuple(calls) if self._policy.stream else (),
        )

    def _visible(self, deltas: list[Delta]) -> list[Delta]:
        if self._include_reasoning:
            return deltas
        return [d for d in deltas if d.reasoning_content is None]

    def _final_call(self, position: int, call: Call) -> ToolCall:
        assert self._args is not None
        name = call.name.strip()
        arguments = self._args.convert(call.raw, False, call.name) if call.raw.strip() else "{}"
        streamed = self._stream.calls[position] if position < len(self._stream.calls) else None
        call_id = streamed.id if streamed is not None and streamed.id else new_call_id()
        return ToolCall(call_id, name, self._args.coerce(arguments, name))
