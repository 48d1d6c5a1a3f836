"""The streaming side of output parsing: one pass of the grammar over text deltas.

Produces stream deltas as text arrives and keeps what a final message needs: the calls with
their raw markup. A tool call's name is streamed as the model wrote it (vLLM does not strip
it while streaming), and its schema is looked up by that name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.chat.arguments import ArgumentConverter, stable_prefix
from server.chat.dialects import Dialect
from server.chat.grammar import TRANSITIONS, State, Terminal, terminal_kinds
from server.chat.lexer import IncrementalLexer, Piece
from server.chat.output import Delta, ToolCallDelta


@dataclass
class Call:
    name_parts: list[str] = field(default_factory=list)
    raw: str = ""  # the markup between `name="...">` and the end of the invoke
    open: bool = True
    index: int | None = None  # position in the stream, once its name was sent
    id: str = ""
    streamed: str = ""  # the arguments JSON text sent so far

    @property
    def name(self) -> str:
        return "".join(self.name_parts)


@dataclass(frozen=True)
class CallPolicy:
    """What the request says about tool calls."""

    parse: bool  # False: tool_choice "none" with tools; the calls block is dropped unread
    stream: bool  # False: also without tools in the request; parsed, never returned
    first_only: bool  # parallel_tool_calls false


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class StreamEngine:
    """Feeds text through the lexer and the grammar; `feed`/`finish` return stream deltas.

    `reasoning`, `content` and `calls` accumulate what was parsed (reasoning without held-back
    trailing whitespace, content without a dropped whitespace-only lead).
    """

    def __init__(
        self,
        dialect: Dialect | None,
        args: ArgumentConverter | None,
        policy: CallPolicy,
        *,
        state: State,
    ) -> None:
        self._kinds = terminal_kinds(dialect)
        self._lexer = IncrementalLexer(tuple(self._kinds))
        self._args = args
        self._policy = policy
        self._state = state
        self.calls: list[Call] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self._reasoning_ws = ""
        self._content_ws = ""

    def feed(self, text: str) -> list[Delta]:
        return self._consume(self._lexer.feed(text))

    def finish(self) -> list[Delta]:
        tail = "".join(piece.text for piece in self._lexer.finish())  # an unfinished terminal
        if tail and self._state is State.REASONING:
            # vLLM flushes this tail as is and forgets the whitespace it held back before it.
            self._reasoning_ws = ""
            self.reasoning.append(tail)
            out = [Delta(reasoning_content=tail)]
        else:
            out = self._text(tail) if tail else []
        out += self._end_call()
        self._state = State.CONTENT
        self._reasoning_ws = ""
        if self._content_ws and not self.calls:
            out += self._emit_content(self._content_ws)
        self._content_ws = ""
        return out

    # ── state machine ─────────────────────────────────────────────────
    def _consume(self, pieces: list[Piece]) -> list[Delta]:
        out: list[Delta] = []
        for piece in pieces:
            kind = self._kinds.get(piece.text) if piece.terminal else None
            if kind is Terminal.DROPPED:
                continue
            target = TRANSITIONS.get((self._state, kind)) if kind else None
            if target is None:
                out += self._text(piece.text)
                continue
            if self._state is State.NAME:
                out += self._end_name()
            elif self._state is State.ARGS:
                out += self._end_call()
            if kind is Terminal.INVOKE_OPEN and self._policy.parse:
                self.calls.append(Call())
                self._content_ws = ""  # whitespace-only content before a call is dropped
            self._state = target
        return out

    def _text(self, text: str) -> list[Delta]:
        if self._state is State.CONTENT:
            return self._content_text(text)
        if self._state is State.REASONING:
            return self._reasoning_text(text)
        call = self._open_call()
        if call is not None and self._state is State.NAME:
            call.name_parts.append(text)
        elif call is not None and self._state is State.ARGS:
            return self._args_text(call, text)
        return []

    # ── reasoning and content ─────────────────────────────────────────
    def _reasoning_text(self, text: str) -> list[Delta]:
        combined = self._reasoning_ws + text
        kept = combined.rstrip()
        self._reasoning_ws = combined[len(kept) :]
        if not kept:
            return []
        self.reasoning.append(kept)
        return [Delta(reasoning_content=kept)]

    def _content_text(self, text: str) -> list[Delta]:
        if not self.content:
            text = self._content_ws + text
            self._content_ws = "" if text.strip() else text
            if self._content_ws:
                return []
        return self._emit_content(text)

    def _emit_content(self, text: str) -> list[Delta]:
        self.content.append(text)
        return [Delta(content=text)]

    # ── tool calls ────────────────────────────────────────────────────
    def _open_call(self) -> Call | None:
        call = self.calls[-1] if self.calls else None
        return call if call is not None and call.open else None

    def _end_name(self) -> list[Delta]:
        """The name is complete: a named call of a request with tools starts streaming."""
        call = self._open_call()
        if call is None or call.index is not None or not call.name or not self._policy.stream:
            return []
        call.index = len(self.calls) - 1
        call.id = new_call_id()
        return self._send(call, ToolCallDelta(call.index, call.id, call.name))

    def _args_text(self, call: Call, text: str) -> list[Delta]:
        out: list[Delta] = []
        for segment in _split_after(text, ">"):
            call.raw += segment
            # vLLM re-converts the arguments only on deltas that contain a '>'.
            if segment.endswith(">") and call.index is not None:
                out += self._extend_arguments(call, self._stable(call))
        return out

    def _end_call(self) -> list[Delta]:
        """The open call (if any) ends, also when cut off: send what its final text adds."""
        out = self._end_name() if self._state is State.NAME else []
        call = self._open_call()
        if call is None:
            return out
        call.open = False
        if call.index is None:
            return out
        final = self._json(call, partial=False)
        if len(final) > len(call.streamed):
            out += self._extend_arguments(call, final)
        return out

    def _json(self, call: Call, partial: bool) -> str:
        assert self._args is not None
        if not partial and not call.raw.strip():
            return "{}"
        return self._args.coerce(self._args.convert(call.raw, partial, call.name), call.name)

    def _stable(self, call: Call) -> str:
        assert self._args is not None
        return stable_prefix(self._json(call, partial=True), self._args.string_keys(call.name))

    def _extend_arguments(self, call: Call, text: str) -> list[Delta]:
        """Send the part of `text` past what was sent, if `text` extends it."""
        assert call.index is not None
        if text == call.streamed or not text.startswith(call.streamed):
            return []
        fragment = text[len(call.streamed) :]
        call.streamed = text
        return self._send(call, ToolCallDelta(call.index, arguments=fragment))

    def _send(self, call: Call, delta: ToolCallDelta) -> list[Delta]:
        if self._policy.first_only and call.index != 0:
            return []
        return [Delta(tool_call=delta)]


def _split_after(text: str, mark: str) -> list[str]:
    parts = text.split(mark)
    return [p + mark for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


