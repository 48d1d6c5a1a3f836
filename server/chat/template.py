"""A checkpoint's own Jinja chat template, rendered the way Hugging Face's apply_chat_template does.

Sandboxed (an untrusted template cannot reach Python internals), with HF's trim_blocks /
lstrip_blocks, loop controls, `{% generation %}` blocks (rendered as their body), a
non-ASCII-preserving `tojson`, `raise_exception` and `strftime_now`. The template sees
messages, tools, the checkpoint's special tokens and every effective chat-template kwarg
(add_generation_prompt, enable_thinking, reasoning_effort, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.chat.errors import ChatRequestError

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _GenerationBlocks(Extension):
    """HF marks assistant text with {% generation %} for training masks; here it is just text."""

    tags = frozenset({"generation"})

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


class ChatTemplate:
    def __init__(
        self, source: str, special_tokens: Mapping[str, str], origin: str = "the checkpoint's chat template"
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationBlocks],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"{origin} does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens)

    @staticmethod
    def from_checkpoint(model_dir: Path, source: str | None = None) -> ChatTemplate | None:
        """`source` (the server's chat.template), else chat_template.jinja, else tokenizer_config.json's
        chat_template; None when none. The special tokens are the checkpoint's either way."""
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        if source is not None:
            return ChatTemplate(source, _special_tokens(config), "chat.template (--chat-template)")
        jinja_path = model_dir / "chat_template.jinja"
        source = jinja_path.read_text() if jinja_path.exists() else _config_template(config)
        if not source:
            return None
        return ChatTemplate(source, _special_tokens(config))

    def render(
        self, body: Mapping[str, Any], tools: list[dict[str, Any]], kwargs: Mapping[str, Any]
    ) -> str:
        variables = {
            **self._special_tokens,
            **kwargs,
            "messages": [dict(m) for m in body["messages"]],
            "tools": tools or None,
            "add_generation_prompt": kwargs.get("add_generation_prompt", True),
        }
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            message = f"the chat template rejected the request: {exc}"
            raise ChatRequestError(message, "messages") from exc


def _config_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
