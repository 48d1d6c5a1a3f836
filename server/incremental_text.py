"""UTF-8 safe incremental detokenization with stop strings, shared by completions and chat."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """Token ids to text; chat passes a decoder that keeps special tokens (its parser reads them)."""

    def decode(self, ids: list[int]) -> str: ...


def _first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=None)


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class IncrementalText:
    """Text deltas of a growing token list. A delta never ends inside a UTF-8 character (a decode that
    ends in U+FFFD is held back until the next token completes it) nor in text that could be the start
    of a stop string (held back until it is not, or the stream ends). At the first stop string the
    text ends just before it and `stopped` is set: nothing past a stop string is ever sent."""

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop, self.token_ids, self.sent, self.stopped = tokenizer, stop, [], "", False

    def push(self, token_ids: tuple[int, ...], final: bool) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        cut = _first_stop(text, self.stop)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - _stop_prefix_len(text, self.stop)]
        delta, self.sent = text[len(self.sent):], text
        return delta
