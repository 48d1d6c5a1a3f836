"""UTF-8 safe incremental detokenization with stop strings, shared by completions and chat."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """Token ids to text; chat passes a decoder that keeps special tokens (its parser reads them)."""

    def decode(self, ids: list[int]) -> str: ...


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in `text`, as the text grows (None: none yet)."""
    return min(((i + len(s), i) for s in stop if (i := text.find(s)) >= 0), default=None)


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class IncrementalText:
    """Text deltas of a growing token list. A delta never ends inside a UTF-8 character (a decode that
    ends in U+FFFD is held back until the next token completes it) nor in text that could be the start
    of a stop string (held back until it is not, or the stream ends). At the first stop string the
    text ends just before it (with it: `include_stop`, vLLM's include_stop_str_in_output) and `stopped` is
    set: nothing past a stop string is ever sent."""

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.tokenizer, self.stop, self.token_ids, self.sent, self.stopped = tokenizer, stop, [], "", False
        self.include_stop = include_stop

    def push(self, token_ids: tuple[int, ...], final: bool) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        cut = _first_stop(text, self.stop)
        if cut is not None:
            end, start = cut
            text, self.stopped = text[: end if self.include_stop else start], True
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - _stop_prefix_len(text, self.stop)]
        delta, self.sent = text[len(self.sent):], text
        return delta
