"""`ChatFormat`: a checkpoint's way from chat request to prompt, and from output to message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    # chat_template_kwargs every request gets under its own (the server's chat.default_template_kwargs)
    default_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def for_checkpoint(
        model_dir: Path | str | None, model_type: str, template_source: str | None = None,
        default_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatFormat:
        """`template_source`: a Jinja template that replaces the checkpoint's own (chat.template)."""
        template = ChatTemplate.from_checkpoint(Path(model_dir), template_source) if model_dir else None
        return ChatFormat(model_type, dialect_for(model_type), template, dict(default_template_kwargs or {}))

    def read(self, body: Mapping[str, Any]) -> ChatRequest:
        """The body as rendering and parsing use it, this server's default template kwargs included."""
        return ChatRequest.from_body(body, self.default_template_kwargs)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text (BOS included) for a chat-completions body; ChatRequestError on 400s."""
        return self.render_request(self.read(body), body)

    def render_request(self, request: ChatRequest, body: Mapping[str, Any]) -> str:
        """`render` for a body already read into `request` (the serving path reads each body once)."""
        if self.template is not None:
            return self.template.render(body, list(request.tools), request.template_kwargs)
        if self.dialect is None:
            raise ChatRequestError(
                f"model type {self.model_type!r} has no chat template: chat is not served"
            )
        return render_request(request, self.dialect)

    def parser(self, body: Mapping[str, Any], prompt: str) -> OutputParser:
        """A parser for the text generated after `prompt` (which tells whether <think> is open)."""
        return self.parser_for(self.read(body), prompt)

    def parser_for(self, request: ChatRequest, prompt: str) -> OutputParser:
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
        return self.parse_for(self.read(body), prompt, text)

    def parse_for(self, request: ChatRequest, prompt: str, text: str) -> ParsedMessage:
        parser = self.parser_for(request, prompt)
        parser.feed(text)
        parser.finish()
        return parser.message()
