"""The DeepSeek-V4 / V4.1 prompt encoder over encoder-format messages.

Encoder-format messages are plain dicts: role system / developer / user / assistant / tool /
latest_reminder; `content`; assistant `tool_calls` (OpenAI shape) and reasoning under the
dialect's key (`reasoning` for V4, `reasoning_content` for V4.1); message-level `tools`
(OpenAI shape), `response_format`, `task` and `wo_eos`. The rules follow vLLM 0.33.0's
`deepseek_v4_encoding` / `deepseek_v41_encoding`, which the golden data were made with.
"""

from __future__ import annotations

import json
from typing import Any

from server.chat import tokens as tk
from server.chat.dialects import Dialect
from server.chat.effort import Effort
from server.chat.errors import ChatRequestError
from server.chat.history import (
    Message,
    drop_history_thinking,
    flat_content,
    last_user_index,
    merge_tool_messages,
    sort_tool_results,
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def encode_messages(
    messages: list[Message],
    dialect: Dialect,
    *,
    thinking_mode: str,
    context: list[Message] | None = None,
    drop_thinking: bool = True,
    reasoning_effort: Effort = None,
    add_default_bos_token: bool = True,
) -> str:
    """Render `messages` (after an already-rendered `context`, if any) as prompt text.

    With a context the BOS is omitted and only the new messages are rendered, but indices,
    the last user turn and thinking drops are computed over the whole conversation.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise ChatRequestError(f"invalid thinking_mode {thinking_mode!r}")
    context = merge_tool_messages(context or [])
    new = merge_tool_messages(messages)
    full = sort_tool_results(context + new)
    thinking = thinking_mode == "thinking"
    # A conversation that declares tools keeps all of its reasoning: the tool loop needs it.
    drop = bool(drop_thinking) and not any(m.get("tools") for m in full)
    if thinking and drop:
        full = drop_history_thinking(full, dialect)
        first = len(drop_history_thinking(context, dialect))
    else:
        first = len(context)
    encoder = _Encoder(full, dialect, thinking, drop, reasoning_effort)
    prompt = tk.BOS if add_default_bos_token and not context else ""
    return prompt + "".join(encoder.render(i) for i in range(first, len(full)))


class _Encoder:
    """Renders one conversation message by message; holds what every message needs to know."""

    def __init__(
        self,
        messages: list[Message],
        dialect: Dialect,
        thinking: bool,
        drop_thinking: bool,
        effort: Effort,
    ) -> None:
        self.messages = messages
        self.dialect = dialect
        self.thinking = thinking
        self.drop_thinking = drop_thinking
        self.effort = effort
        self.last_user = last_user_index(messages, dialect)

    def render(self, index: int) -> str:
        msg = self.messages[index]
        return self._prefix(index, msg) + self._body(index, msg) + self._transition(index, msg)

    def _prefix(self, index: int, msg: Message) -> str:
        effort = self.dialect.effort.prompt(self.effort)  # validates on every message
        effort = effort if index == 0 and self.thinking else ""
        if self.dialect.system_token and index == 0 and (effort or msg.get("role") == "system"):
            return tk.SYSTEM + effort
        return effort

    def _body(self, index: int, msg: Message) -> str:
        role = msg.get("role")
        if role == "system":
            lead = tk.SYSTEM if self.dialect.system_token and index > 0 else ""
            return lead + (flat_content(msg.get("content")) or "") + self._attachments(msg)
        if role == "developer":
            content = flat_content(msg.get("content"))
            if not content:
                raise ChatRequestError("a developer message needs non-empty content", "messages")
            return tk.USER + content + self._attachments(msg)
        if role == "user":
            return tk.USER + self._user_text(msg)
        if role == "latest_reminder":
            return tk.LATEST_REMINDER + str(flat_content(msg.get("content")))
        if role == "assistant":
            return self._assistant(index, msg)
        raise ChatRequestError(f"unsupported message role {role!r}", "messages")

    def _attachments(self, msg: Message) -> str:
        text = ""
        if msg.get("tools"):
            text += "\n\n" + self._tools_block([t["function"] for t in msg["tools"]])
        if msg.get("response_format"):
            schema = to_json(msg["response_format"])
            text += "\n\n" + tk.RESPONSE_FORMAT_TEMPLATE.format(schema=schema)
        return text

    def _tools_block(self, functions: list[dict[str, Any]]) -> str:
        d = self.dialect
        return tk.TOOLS_TEMPLATE.format(
            dsml=tk.DSML,
            calls=d.calls_tag,
            invoke=d.invoke_tag,
            parameter=d.parameter_tag,
            think_start=tk.THINK_START,
            think_end=tk.THINK_END,
            schemas="\n".join(to_json(f) for f in functions),
        )

    def _user_text(self, msg: Message) -> str:
        blocks = msg.get("content_blocks")
        if not blocks:
            return msg.get("content") or ""
        return "\n\n".join(_block_text(block) for block in blocks)

    def _assistant(self, index: int, msg: Message) -> str:
        calls = self._tool_calls_block(msg.get("tool_calls") or [])
        # A turn answering a task (previous message has one) never shows reasoning; history
        # turns before the last user turn lose theirs when thinking is dropped.
        answers_task = index > 0 and self.messages[index - 1].get("task") is not None
        shows_reasoning = not self.drop_thinking or index > self.last_user
        reasoning = ""
        if self.thinking and not answers_task and shows_reasoning:
            reasoning = (msg.get(self.dialect.reasoning_key) or "") + tk.THINK_END
        text = reasoning + (flat_content(msg.get("content")) or "") + calls
        return text if msg.get("wo_eos") else text + tk.EOS

    def _tool_calls_block(self, calls: list[dict[str, Any]]) -> str:
        if not calls:
            return ""
        d = self.dialect
        invokes = [
            f'{d.invoke_open}{call["function"]["name"]}">\n'
            f"{self._parameters(call['function'].get('arguments'))}\n{d.invoke_close}"
            for call in calls
        ]
        return "\n\n" + d.calls_open + "\n" + "\n".join(invokes) + "\n" + d.calls_close

    def _parameters(self, arguments: Any) -> str:
        d = self.dialect
        return "\n".join(
            f'{d.parameter_open} name="{key}" string="{_is_string(value)}">'
            f"{value if isinstance(value, str) else to_json(value)}{d.parameter_close}"
            for key, value in self._arguments_dict(arguments).items()
        )

    def _arguments_dict(self, arguments: Any) -> dict[str, Any]:
        """History tool-call arguments as a dict.

        V4 decodes JSON text and rejects anything that is not an object; V4.1 also accepts
        double-encoded JSON and wraps anything else as {"arguments": <raw>}.
        """
        if self.dialect.strict_history_arguments:
            try:
                decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError as exc:
                message = f"tool call arguments are not JSON: {exc}"
                raise ChatRequestError(message, "messages") from exc
            if not isinstance(decoded, dict):
                raise ChatRequestError("tool call arguments must be a JSON object", "messages")
            return decoded
        decoded = arguments
        for _ in range(2):
            if not isinstance(decoded, str):
                break
            try:
                decoded = json.loads(decoded)
            except ValueError:
                break
        return decoded if isinstance(decoded, dict) else {"arguments": arguments}

    def _system_opens(self, index: int) -> bool:
        """Whether a system turn is followed by the assistant header.

        V4.1: any non-leading one (it acts as a user turn). V4: a trailing one, or one that an
        assistant turn follows.
        """
        if self.dialect.v41_turns:
            return index > 0
        is_last = index == len(self.messages) - 1
        return is_last or self.messages[index + 1].get("role") == "assistant"

    def _transition(self, index: int, msg: Message) -> str:
        """What follows a message: nothing, a task token, or the assistant header."""
        is_last = index == len(self.messages) - 1
        next_role = None if is_last else self.messages[index + 1].get("role")
        if not is_last and next_role not in ("assistant", "latest_reminder"):
            return ""
        role = msg.get("role")
        task = msg.get("task")
        if task is not None:
            if task not in tk.TASK_TOKENS:
                raise ChatRequestError(f"invalid task {task!r}", "messages")
            if task != "action":
                return tk.TASK_TOKENS[task]
            think = tk.THINK_START if self.thinking else tk.THINK_END
            return tk.ASSISTANT + think + tk.TASK_TOKENS[task]
        system_opens = role == "system" and self._system_opens(index)
        if role not in ("user", "developer") and not system_opens:
            return ""
        open_think = self.thinking and (not self.drop_thinking or index >= self.last_user)
        return tk.ASSISTANT + (tk.THINK_START if open_think else tk.THINK_END)


def _is_string(value: Any) -> str:
    return "true" if isinstance(value, str) else "false"


def _block_text(block: dict[str, Any]) -> str:
    kind = block.get("type")
    if kind == "text":
        return block.get("text") or ""
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, list):
            content = "\n\n".join(
                p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                for p in content
            )
        return tk.TOOL_RESULT_TEMPLATE.format(content=content)
    return f"[Unsupported {kind}]"
