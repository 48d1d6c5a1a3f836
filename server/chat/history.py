"""Encoder-format message-list transforms that run before rendering.

DeepSeek-V4 has no tool role: tool results become `<tool_result>` blocks of a user turn, in
the order of the calls that asked for them. In thinking mode, turns before the last user turn
lose their reasoning (and developer turns vanish) unless told otherwise.
"""

from __future__ import annotations

import copy
from typing import Any

from server.chat.dialects import Dialect
from server.chat.errors import ChatRequestError

Message = dict[str, Any]

_ALWAYS_KEPT = {"user", "system", "tool", "latest_reminder", "direct_search_results"}


def flat_content(content: Any) -> Any:
    """List-of-parts content as text (text parts joined with a blank line); else unchanged."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict):
            parts.append(str(part))
        elif part.get("type") == "text":
            parts.append(part.get("text", ""))
        else:
            kind = part.get("type")
            raise ChatRequestError(f"unsupported content part type {kind!r}", "messages")
    return "\n\n".join(parts)


def merge_tool_messages(messages: list[Message]) -> list[Message]:
    """Fold tool results, and user turns that follow them, into one user turn of blocks."""
    merged: list[Message] = []
    for msg in copy.deepcopy(messages):
        role = msg.get("role")
        last = merged[-1] if merged else None
        open_user = last is not None and last.get("role") == "user" and "content_blocks" in last
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": msg.get("tool_call_id", ""),
                "content": msg.get("content", ""),
            }
            if open_user:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = msg.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": flat_content(msg.get("content", ""))}]
            if open_user and last.get("task") is None:
                last["content_blocks"].extend(blocks)
            else:
                msg["content_blocks"] = blocks
                merged.append(msg)
        else:
            merged.append(msg)
    return merged


def _call_id(call: dict[str, Any]) -> str:
    return call.get("id") or call.get("function", {}).get("id", "")


def sort_tool_results(messages: list[Message]) -> list[Message]:
    """Order each user turn's tool results like the preceding assistant's tool calls (in place)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {cid: i for i, call in enumerate(msg["tool_calls"]) if (cid := _call_id(call))}
        elif msg.get("role") == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [
                    next(ranked) if b.get("type") == "tool_result" else b
                    for b in msg["content_blocks"]
                ]
    return messages


def last_user_index(messages: list[Message], dialect: Dialect) -> int:
    """Index of the last user turn, or -1.

    User and developer turns count. V4.1 also counts a non-leading system turn, and skips a
    user turn that only carries tool results (it continues the assistant's turn).
    """
    for idx in range(len(messages) - 1, -1, -1):
        role = messages[idx].get("role")
        if dialect.v41_turns and role in ("user", "developer"):
            blocks = messages[idx].get("content_blocks")
            if blocks and not any(b.get("type") in ("text", "image", "image_url") for b in blocks):
                continue
        if role in ("user", "developer") or (dialect.v41_turns and role == "system" and idx > 0):
            return idx
    return -1


def drop_history_thinking(messages: list[Message], dialect: Dialect) -> list[Message]:
    """Strip reasoning from assistant turns before the last user turn; drop developer turns."""
    last_user = last_user_index(messages, dialect)
    kept: list[Message] = []
    for idx, msg in enumerate(messages):
        role = msg.get("role")
        if role in _ALWAYS_KEPT or idx >= last_user:
            kept.append(msg)
        elif role == "assistant":
            stripped = dict(msg)
            stripped.pop(dialect.reasoning_key, None)
            kept.append(stripped)
    return kept
