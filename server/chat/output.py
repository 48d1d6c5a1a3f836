"""What the output parser hands to the HTTP layer: stream deltas and the final message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of a streamed tool call; the first fragment of a call carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        return {**out, "function": function}


@dataclass(frozen=True)
class Delta:
    """Exactly one of the three fields is set."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def to_openai(self) -> dict[str, Any]:
        """The `delta` object of a chat.completion.chunk choice."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_openai()]}
        if self.content is not None:
            return {"content": self.content}
        return {"reasoning_content": self.reasoning_content}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedMessage:
    """The assistant message of a finished generation; empty fields are None."""

    reasoning_content: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]

    def finish_reason(self, engine_reason: str) -> str:
        """vLLM's rule: a generation that stopped normally with tool calls reports tool_calls."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def to_openai(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message
