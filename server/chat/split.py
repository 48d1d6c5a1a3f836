"""Reasoning / content split of a whole generation, as vLLM's non-streaming path does it.

vLLM first splits the whole text on <think> / </think> with tool parsing off (a calls block
opened inside reasoning ends it), then parses tool calls out of the content. So a <think>
block after a tool call still counts as reasoning there, while its stream drops it.
"""

from __future__ import annotations

from server.chat.dialects import Dialect
from server.chat.grammar import State, Terminal, terminal_kinds
from server.chat.lexer import IncrementalLexer


def split_reasoning(text: str, dialect: Dialect | None, reasoning_open: bool) -> tuple[str, str]:
    """(reasoning with trailing whitespace removed, content including any tool markup)."""
    kinds = terminal_kinds(dialect)
    lexer = IncrementalLexer(tuple(kinds))
    state = State.REASONING if reasoning_open and dialect else State.CONTENT
    parts: dict[State, list[str]] = {State.REASONING: [], State.CONTENT: []}
    for piece in lexer.feed(text) + lexer.finish():
        kind = kinds.get(piece.text) if piece.terminal else None
        if kind is Terminal.DROPPED or kind in (Terminal.THINK_START, Terminal.THINK_END):
            if kind is Terminal.THINK_START:
                state = State.REASONING
            elif kind is Terminal.THINK_END:
                state = State.CONTENT
            continue
        if kind is Terminal.CALLS_OPEN and state is State.REASONING:
            state = State.CONTENT
        parts[state].append(piece.text)
    return "".join(parts[State.REASONING]).rstrip(), "".join(parts[State.CONTENT])
