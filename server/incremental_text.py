"""UTF-8 safe incremental detokenization with stop strings, shared by completions and chat.

A push costs work in proportion to the tokens it adds, not to the output so far: the decoder reads
only a window of the last tokens (vLLM's prefix and read offsets), and stop strings are looked for only
where a new match can end. Re-decoding the whole output at every push is quadratic, and at 32 streams
of 1,000 tokens it was most of the front end's time. The deltas are exactly those of decoding the
whole token list at every push (tests/test_incremental_text_oracle.py checks them against that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

WINDOW_TOKENS = 16  # a window longer than this moves up to the last complete point but one


class Decoder(Protocol):
    """Token ids to text; chat passes a decoder that keeps special tokens (its parser reads them)."""

    def decode(self, ids: list[int]) -> str: ...


class DecodeWindow:
    """The text a growing token list adds, decoded from a window of its last tokens.

    The window starts where the text was complete (no unfinished character) one push before a later
    complete point, so the decoder sees at least one token of context: a decoder that treats a list's
    first token apart (drops its leading space) treats the window's first token so every time, and the
    difference of two decodes of the window is the whole list's new text. A decoder whose window text
    does not extend the text decoded before is read from the first token on from then on.
    """

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.token_ids: list[int] = []
        self._start = 0  # the window's first token
        self._complete = 0  # tokens whose text is complete
        self._complete_text = ""  # decode(token_ids[_start:_complete])
        self._text = ""  # decode(token_ids[_start:]) at the last `extend`
        self._whole = False  # the decoder is not local: decode from the first token

    def extend(self, token_ids: Sequence[int]) -> str:
        """Adds `token_ids`; returns the text past the complete text (ending in U+FFFD while a character
        is unfinished)."""
        self.token_ids.extend(token_ids)
        self._text = self.decoder.decode(self.token_ids[self._start:])
        if not self._whole and not self._text.startswith(self._complete_text):
            self._whole, self._start = True, 0
            self._complete_text = self.decoder.decode(self.token_ids[: self._complete])
            self._text = self.decoder.decode(self.token_ids)
        return self._text[len(self._complete_text):]

    def complete(self) -> None:
        """The text so far is complete: the next `extend` returns only what follows it."""
        previous, self._complete, self._complete_text = self._complete, len(self.token_ids), self._text
        # the window keeps a token before what the next push adds: not past a push that added none
        if not self._whole and self._complete - self._start > WINDOW_TOKENS and self._start < previous < self._complete:
            self._start = previous
            self._complete_text = self.decoder.decode(self.token_ids[previous: self._complete])


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, int] | None:
    """(end, start) of the stop string that ends first in `text`, as the text grows (None: none yet)."""
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
        self.stop, self.include_stop, self.stopped = stop, include_stop, False
        self._window = DecodeWindow(tokenizer)
        self._sent: list[str] = []
        self._held = ""  # complete text not sent yet: it could begin a stop string
        self._recent = ""  # the complete text's last characters, as many as a stop string has less one
        self._reach = max(map(len, stop), default=1) - 1

    @property
    def sent(self) -> str:
        """The text sent so far."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    @property
    def token_ids(self) -> list[int]:
        return self._window.token_ids

    def push(self, token_ids: Sequence[int], final: bool) -> str:
        if self.stopped:
            return ""
        tail = self._window.extend(token_ids)
        pending = self._held + tail  # everything decoded past what was sent
        # a stop string seen now ends in `tail`; `_recent` holds where it may begin before it
        cut = _first_stop(self._recent + tail, self.stop)
        if cut is not None:
            end, start = cut
            self.stopped = True
            return self._send(pending[: (end if self.include_stop else start) + len(self._held) - len(self._recent)])
        if final:
            return self._send(pending)
        if tail.endswith("\ufffd"):
            return ""
        self._window.complete()
        self._recent = (self._recent + tail)[-self._reach:] if self._reach else ""
        keep = len(pending) - _stop_prefix_len(self._recent, self.stop)
        self._held = pending[keep:]
        return self._send(pending[:keep])

    def _send(self, delta: str) -> str:
        if delta:
            self._sent.append(delta)
        return delta
