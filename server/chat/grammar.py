"""The DSML output grammar as a transition table (vLLM 0.33.0's `deepseek_v4` parser engine).

A terminal with no transition from the current state is plain text of that state; text in
PREAMBLE and BETWEEN is dropped, so once a tool call starts only further calls are read.
"""

from __future__ import annotations

from enum import Enum, auto

from server.chat import tokens as tk
from server.chat.dialects import Dialect


class State(Enum):
    CONTENT = auto()
    REASONING = auto()
    PREAMBLE = auto()  # inside a calls block, before an invoke
    NAME = auto()
    ARGS = auto()
    BETWEEN = auto()  # after an invoke


class Terminal(Enum):
    THINK_START = auto()
    THINK_END = auto()
    CALLS_OPEN = auto()
    CALLS_CLOSE = auto()
    INVOKE_OPEN = auto()
    NAME_END = auto()
    INVOKE_CLOSE = auto()
    PARAM_OPEN = auto()
    PARAM_CLOSE = auto()
    DROPPED = auto()  # special tokens that are no part of the answer (BOS, EOS)


TRANSITIONS = {
    (State.CONTENT, Terminal.THINK_START): State.REASONING,
    (State.CONTENT, Terminal.THINK_END): State.CONTENT,  # a stray </think> is swallowed
    (State.REASONING, Terminal.THINK_START): State.REASONING,  # so is a duplicate <think>
    (State.REASONING, Terminal.THINK_END): State.CONTENT,
    (State.REASONING, Terminal.CALLS_OPEN): State.PREAMBLE,
    (State.CONTENT, Terminal.CALLS_OPEN): State.PREAMBLE,
    (State.CONTENT, Terminal.INVOKE_OPEN): State.NAME,  # an invoke without its block
    (State.PREAMBLE, Terminal.INVOKE_OPEN): State.NAME,
    (State.NAME, Terminal.NAME_END): State.ARGS,
    (State.ARGS, Terminal.INVOKE_CLOSE): State.BETWEEN,
    (State.ARGS, Terminal.CALLS_CLOSE): State.BETWEEN,
    (State.BETWEEN, Terminal.INVOKE_OPEN): State.NAME,
    (State.BETWEEN, Terminal.CALLS_CLOSE): State.BETWEEN,  # a tool call ends the turn
    (State.BETWEEN, Terminal.CALLS_OPEN): State.PREAMBLE,
}


def terminal_kinds(dialect: Dialect | None) -> dict[str, Terminal]:
    """Every terminal spelling of a dialect (none for a family without one)."""
    if dialect is None:
        return {}
    kinds = {
        tk.THINK_START: Terminal.THINK_START,
        tk.THINK_END: Terminal.THINK_END,
        dialect.calls_open: Terminal.CALLS_OPEN,
        dialect.calls_close: Terminal.CALLS_CLOSE,
        dialect.invoke_open: Terminal.INVOKE_OPEN,
        '">': Terminal.NAME_END,
        dialect.invoke_close: Terminal.INVOKE_CLOSE,
        dialect.parameter_open: Terminal.PARAM_OPEN,
        dialect.parameter_close: Terminal.PARAM_CLOSE,
        tk.BOS: Terminal.DROPPED,
        tk.EOS: Terminal.DROPPED,
    }
    kinds.update((alias, Terminal.CALLS_OPEN) for alias in dialect.calls_open_aliases)
    return kinds


def reasoning_open(prompt: str) -> bool:
    """Whether the prompt leaves the model inside a <think> block."""
    return prompt.rfind(tk.THINK_START) > prompt.rfind(tk.THINK_END)
