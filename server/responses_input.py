"""A Responses request as a chat-completions request, so that rendering, sampling, reasoning and
tool-call parsing are the chat path's own (server/chat_completions.py, server/chat).

The conversation becomes chat messages: the instructions (a system message), the stored
conversation that `previous_response_id` names, then the input items. As vLLM merges them, a
reasoning item, an assistant message and function calls that follow each other are one assistant
turn (its reasoning, content and tool_calls); an item that cannot continue the turn in that order
(a second reasoning item, text after a call) starts the next assistant turn. A function_call_output
is a tool message answering its call_id. The instructions belong to this request only: the
conversation a response keeps for the next turn leaves them out, as OpenAI's do not carry over.

The other fields map onto the chat fields that mean the same (max_output_tokens onto
max_completion_tokens, reasoning.effort onto reasoning_effort, text.format onto response_format,
flat function tools onto nested ones). A 400 raised on the chat side names the chat field;
`responses_params` renames it to the Responses field the client sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from contract import RequestRejected
from server.chat import ChatRequestError
from server.chat_protocol import ChatCompletionRequest
from server.http_errors import validation_message
from server.request_errors import ClientError
from server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
    TextPart,
)

Message = dict[str, Any]
# chat fields whose Responses counterpart has another name
RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
}
# fields that keep their chat name and meaning
PASSED_THROUGH = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "logit_bias", "cache_salt", "user", "parallel_tool_calls")
TURN_ORDER = ("reasoning", "content", "tool_calls")  # the parts of one assistant turn, in order


def _content(content: str | list[TextPart]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _continues(last: Message | None, part: str) -> bool:
    """Whether `part` of an assistant turn continues the assistant message `last`: a turn is its
    reasoning, then its content, then any number of tool calls."""
    if last is None or last["role"] != "assistant":
        return False
    filled = [index for index, name in enumerate(TURN_ORDER) if last.get(name) is not None]
    place = TURN_ORDER.index(part)
    return not filled or filled[-1] < place or (part == "tool_calls" and filled[-1] == place)


def chat_messages(items: str | list[InputItem]) -> list[Message]:
    """The chat messages of Responses input: a string is one user message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Message] = []
    for item in items:
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": _content(item.content)})
        else:
            part, value = _assistant_part(item)
            if _continues(last, part):
                assert last is not None
                last[part] = [*last[part], *value] if part == "tool_calls" and last.get(part) else value
            else:
                messages.append({"role": "assistant", "content": None, part: value})
    return messages


def _assistant_part(item: MessageItem | FunctionCallItem | ReasoningItem) -> tuple[str, Any]:
    if isinstance(item, ReasoningItem):
        return "reasoning", item.text
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        return "tool_calls", [call]
    return "content", _content(item.content)


def conversation(body: ResponsesRequest, history: tuple[Message, ...]) -> tuple[list[Message], tuple[Message, ...]]:
    """(the messages to render, the conversation to keep for the next turn: no instructions)."""
    turn = (*history, *chat_messages(body.input))
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return [*system, *turn], turn


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _chat_tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    if choice == "auto" and not body.tools:
        return None  # the Responses default; the chat path's "auto" needs tools
    return choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": text.format.name, "schema": text.format.schema_, "description": text.format.description,
            "strict": text.format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def chat_request(body: ResponsesRequest, messages: list[Message]) -> ChatCompletionRequest:
    """The chat request that generates this response; a value out of the chat path's ranges is a
    ClientError naming the Responses field. It asks for the output's token ids, which count the
    reasoning tokens."""
    fields = {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [_chat_tool(tool) for tool in body.tools] or None,
        "tool_choice": _chat_tool_choice(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "response_format": _response_format(body.text),
        "return_token_ids": True,
        **{name: getattr(body, name) for name in PASSED_THROUGH},
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise _renamed(message, param) from None


def _renamed(message: str, param: str | None) -> ClientError:
    if param is None:
        return ClientError(message)
    name = RENAMED.get(param, param)
    return ClientError(name + message[len(param):] if message.startswith(param) else message, name)


@contextmanager
def responses_params() -> Iterator[None]:
    """Re-raises a 400 of the chat path (or of the engine's checks) naming the Responses field."""
    try:
        yield
    except (ClientError, ChatRequestError, RequestRejected) as exc:
        raise _renamed(str(exc), exc.param) from exc
