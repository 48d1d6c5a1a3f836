"""Chat request to prompt text through the built-in DeepSeek-V4 / V4.1 encoder.

This is vLLM 0.33.0's request path (protocol merge, chat parsing, the tokenizer wrapper's
knob handling, then the encoder), reproduced byte for byte: thinking is on by default, the
effort prefix follows the version's table, request tools attach to the first system turn,
and add_generation_prompt / continue_final_message do not change the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from server.chat.dialects import Dialect
from server.chat.encoding import encode_messages
from server.chat.errors import ChatRequestError
from server.chat.history import Message
from server.chat.request import ChatRequest, RequestMessage


def render_request(request: ChatRequest, dialect: Dialect) -> str:
    thinking, effort = dialect.effort.resolve(request.template_kwargs)
    messages = [_encoder_message(m, dialect) for m in request.messages]
    if request.tools:
        _attach_tools(messages, list(request.tools))
    return encode_messages(
        messages,
        dialect,
        thinking_mode="thinking" if thinking else "chat",
        drop_thinking=request.template_kwargs.get("drop_thinking", True),
        reasoning_effort=effort,
    )


def _encoder_message(msg: RequestMessage, dialect: Dialect) -> Message:
    """The encoder-format message vLLM hands the version's encoder for one request message.

    Both versions see history tool-call arguments decoded to an object: vLLM's chat parsing
    decodes them in place, in the very dicts the V4.1 path reads.
    """
    if dialect.forbidden_text and any(dialect.forbidden_text in t for t in msg.texts()):
        raise ChatRequestError(
            f"message text contains the image token {dialect.forbidden_text!r}; "
            "images are not supported",
            "messages",
        )
    out: Message = {"role": msg.role, "content": _joined(msg, dialect)}
    parsed = dialect.conversation_view
    if msg.reasoning is not None and (msg.role == "assistant" or not parsed):
        out[dialect.reasoning_key] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [_decoded_arguments(c) for c in msg.tool_calls]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.task is not None:
        out["task"] = msg.task
    if msg.tools is not None and (msg.role == "developer" or not parsed):
        out["tools"] = list(msg.tools)
    return out


def _joined(msg: RequestMessage, dialect: Dialect) -> str | None:
    if not isinstance(msg.content, tuple):
        return msg.content
    return ("\n" if msg.role == "tool" and dialect.conversation_view else "\n\n").join(msg.content)


def _decoded_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat parsing turns history arguments into a dict; anything but an object is {}."""
    arguments = call["function"].get("arguments")
    decoded: Any = {}
    if isinstance(arguments, dict):
        decoded = arguments
    elif isinstance(arguments, str) and arguments:
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = {}
    decoded = decoded if isinstance(decoded, dict) else {}
    return {**call, "function": {**call["function"], "arguments": decoded}}


def _attach_tools(messages: list[Message], tools: list[dict[str, Any]]) -> None:
    """Request tools go on the first system turn, or on a new empty one in front."""
    host = next((m for m in messages if m["role"] == "system"), None)
    if host is None:
        host = {"role": "system"}
        messages.insert(0, host)
    host["tools"] = tools
