"""`ChatFormat`: a checkpoint's way from chat request to prompt, and from output to message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.chat.dialects import Dialect, dialect_for
from server.chat.errors import ChatRequestError
from server.chat.grammar import reasoning_open
from server.chat.output import ParsedMessage
from server.chat.parse import OutputParser
from server.chat.render import render_request
from server.chat.request import ChatRequest
from server.chat.template import ChatTemplate


@dataclass(frozen=True)
class ChatFormat:
    model_type: str
    dialect: Dialect | None  # built-in encoder and output parser; None for other families
    template: ChatTemplate | None  # the checkpoint's own template, which wins when present

    @staticmethod
    def for_checkpoint(model_dir: Path | str | None, model_type: str) -> ChatFormat:
        template = ChatTemplate.from_checkpoint(Path(model_dir)) if model_dir else None
        return ChatFormat(model_type, dialect_for(model_type), template)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text (BOS included) for a chat-completions body; ChatRequestError on 400s."""
        request = ChatRequest.from_body(body)
        if self.template is not None:
            return self.template.render(body, list(request.tools), request.template_kwargs)
        if self.dialect is None:
            raise ChatRequestError(
                f"model type {self.model_type!r} has no chat template: chat is not served"
            )
        return render_request(request, self.dialect)

    def parser(self, body: Mapping[str, Any], prompt: str) -> OutputParser:
        """A parser for the text generated after `prompt` (which tells whether <think> is open)."""
        request = ChatRequest.from_body(body)
        return OutputParser(
            self.dialect,
            reasoning_open=reasoning_open(prompt),
            tools=list(request.tools),
            tool_choice=request.tool_choice,
            include_reasoning=request.include_reasoning,
            parallel_tool_calls=request.parallel_tool_calls,
        )

    def parse(self, body: Mapping[str, Any], prompt: str, text: str) -> ParsedMessage:
        """The final message for a whole generation (non-streaming responses)."""
        parser = self.parser(body, prompt)
        parser.feed(text)
        parser.finish()
        return parser.message()
