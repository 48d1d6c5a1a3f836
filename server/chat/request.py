"""Validation of an OpenAI chat-completions body, down to what chat rendering and parsing use.

Consumed fields: messages, tools, tool_choice, reasoning_effort, chat_template_kwargs,
include_reasoning, parallel_tool_calls, add_generation_prompt, continue_final_message and
documents. Everything else (sampling, stream, ...) belongs to other layers.

Rendering and parsing walk these values recursively (copy.deepcopy, json.dumps, the template, the
tool schemas), so a body nested deeper than MAX_NESTING is refused first, naming its field: past
Python's recursion limit it would be a RecursionError (500). No real tool schema or message comes
near the bound.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from server.chat.errors import ChatRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
# objects and lists inside one top-level field; each frame of a recursive walk (deepcopy takes two a
# level) stays far below the default recursion limit of 1000 with the server's own frames on top
MAX_NESTING = 128
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
THINKING_KEYS = ("thinking", "enable_thinking")


@dataclass(frozen=True)
class RequestMessage:
    """One message; list content is kept as its text parts, since versions join them differently."""

    role: str
    content: str | tuple[str, ...] | None
    reasoning: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    task: str | None = None  # DeepSeek quick-instruction task marker, passed through
    tools: tuple[dict[str, Any], ...] | None = None  # tools declared on the message itself

    def texts(self) -> list[str]:
        """Every text the client typed into this message."""
        parts = list(self.content) if isinstance(self.content, tuple) else [self.content or ""]
        return parts + [self.reasoning or ""]


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[RequestMessage, ...]
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}} as vLLM dumps it
    tool_choice: str  # "auto", "none", "required" (a call of some tool) or "function" (of tool_name)
    template_kwargs: Mapping[str, Any]  # the effective chat-template kwargs (vLLM's merge)
    include_reasoning: bool
    parallel_tool_calls: bool
    tool_name: str | None = None  # tool_choice "function": the tool that must be called

    @staticmethod
    def from_body(body: Mapping[str, Any], default_template_kwargs: Mapping[str, Any] | None = None) -> ChatRequest:
        """`default_template_kwargs`: the server's chat.default_template_kwargs, under the request's own."""
        if not isinstance(body, Mapping):
            raise ChatRequestError("the request body must be a JSON object")
        _refuse_deep_nesting(body)
        tools = _tools(body.get("tools"))
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise ChatRequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        include, parallel = body.get("include_reasoning", True), body.get("parallel_tool_calls")
        if not isinstance(include, bool):
            raise ChatRequestError("include_reasoning must be a boolean", "include_reasoning")
        if parallel is not None and not isinstance(parallel, bool):
            raise ChatRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
        tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
        return ChatRequest(
            messages=_messages(body.get("messages")),
            tools=tools,
            tool_choice=tool_choice,
            tool_name=tool_name,
            template_kwargs=_template_kwargs(body, default_template_kwargs or {}),
            include_reasoning=include,
            parallel_tool_calls=parallel is not False,
        )


def _refuse_deep_nesting(body: Mapping[str, Any]) -> None:
    """Raises ChatRequestError naming the first top-level field nested deeper than MAX_NESTING
    objects and lists; walks iteratively, so any depth is measured without recursion."""
    for field, value in body.items():
        stack = [(value, 1)]
        while stack:
            node, depth = stack.pop()
            if not isinstance(node, (Mapping, list)):
                continue
            if depth > MAX_NESTING:
                raise ChatRequestError(f"{field} is nested deeper than {MAX_NESTING} objects and lists", field)
            children = node.values() if isinstance(node, Mapping) else node
            stack.extend((child, depth + 1) for child in children)


def _messages(raw: Any) -> tuple[RequestMessage, ...]:
    if not isinstance(raw, list) or not raw:
        raise ChatRequestError("messages must be a non-empty list", "messages")
    return tuple(_message(m) for m in raw)


def _message(raw: Any) -> RequestMessage:
    if not isinstance(raw, Mapping) or raw.get("role") not in ROLES:
        raise ChatRequestError(f"each message needs a role among {', '.join(ROLES)}", "messages")
    reasoning = raw.get("reasoning")
    if reasoning is None:  # vLLM folds the older reasoning_content field into reasoning
        reasoning = raw.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatRequestError("message reasoning must be a string", "messages")
    if "content" in raw and raw["content"] is None and raw["role"] != "assistant":
        raise ChatRequestError(f"a {raw['role']} message needs content", "messages")
    tool_call_id, task, tools = raw.get("tool_call_id"), raw.get("task"), raw.get("tools")
    return RequestMessage(
        role=raw["role"],
        content=_content(raw.get("content")),
        reasoning=reasoning,
        tool_calls=_tool_calls(raw.get("tool_calls")),
        tool_call_id=tool_call_id if isinstance(tool_call_id, str) else None,
        task=task if isinstance(task, str) else None,
        tools=_tools(tools) if tools else None,
    )


def _content(raw: Any) -> str | tuple[str, ...] | None:
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ChatRequestError("message content must be a string or a list of parts", "messages")
    texts = []
    for part in raw:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            message = f"only text content parts are supported, got {kind!r}"
            raise ChatRequestError(message, "messages")
        if not isinstance(part.get("text"), str):
            raise ChatRequestError("a text content part needs a string 'text'", "messages")
        texts.append(part["text"])
    return tuple(texts)


def _tool_calls(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ChatRequestError("tool_calls must be a list", "messages")
    for call in raw:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatRequestError("each tool call needs a function with a name", "messages")
        if call.get("type", "function") != "function":
            raise ChatRequestError("only tool calls of type 'function' are supported", "messages")
    return tuple(copy.deepcopy(dict(call)) for call in raw)


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise ChatRequestError("tools must be a non-empty list (or left out)", "tools")
    return tuple(_tool(t) for t in raw)


def _tool(raw: Any) -> dict[str, Any]:
    """A tool as vLLM's model_dump() leaves it: declared fields first, then any extras."""
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function":
        raise ChatRequestError("only tools of type 'function' are supported", "tools")
    function = raw.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatRequestError("each tool needs a function with a string name", "tools")
    description, parameters = function.get("description"), function.get("parameters")
    if description is not None and not isinstance(description, str):
        raise ChatRequestError("a tool description must be a string", "tools")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ChatRequestError("tool parameters must be a JSON object", "tools")
    dumped = {"name": function["name"], "description": description, "parameters": parameters}
    if function.get("defer_loading") is not None:
        dumped["defer_loading"] = function["defer_loading"]
    dumped.update((k, v) for k, v in function.items() if k not in dumped and k != "defer_loading")
    return {"type": "function", "function": dumped}


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """(choice, the named tool): "required" and a named function are kept to constrained decoding
    (server/structured_outputs.py), which makes the output a call of the tools."""
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw == "none":
        return raw, None
    if not tools:
        raise ChatRequestError("tool_choice needs tools", "tool_choice")
    if raw in ("auto", "required"):
        return raw, None
    if isinstance(raw, Mapping) and raw.get("type") == "function" and isinstance(raw.get("function"), Mapping):
        name = raw["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ChatRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return "function", name
    message = "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
    raise ChatRequestError(message, "tool_choice")


def _template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The server's defaults, then chat_template_kwargs, then the top-level knobs that are set, as
    vLLM merges them (its --default-chat-template-kwargs lie under the request's keys).

    A top-level reasoning_effort also sets enable_thinking (off for "none") unless the client
    set enable_thinking itself; so effort "high" overrides chat_template_kwargs.thinking=false.
    thinking and enable_thinking are one knob spelled two ways: a request that sets either (or an
    effort) drops both from the defaults, so its own choice is the one rendered.
    """
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, Mapping):
        raise ChatRequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise ChatRequestError(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}", "reasoning_effort"
        )
    top = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        top["enable_thinking"] = effort != "none"
    own = {**user, **{k: v for k, v in top.items() if v is not None}}
    if any(key in own for key in THINKING_KEYS):
        defaults = {k: v for k, v in defaults.items() if k not in THINKING_KEYS}
    return {**defaults, **own}
