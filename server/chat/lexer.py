"""Incremental splitting of generated text into plain text and literal terminals.

A terminal split across deltas must still be recognised, so a tail that could still grow into
a terminal is held back until the next delta (or `finish`) decides it. Matches are leftmost;
no terminal of a DeepSeek dialect contains another, so the split of the whole text does not
depend on how it was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    text: str
    terminal: bool  # True: `text` is exactly one of the lexer's terminals


class IncrementalLexer:
    def __init__(self, terminals: tuple[str, ...]) -> None:
        self._terminals = tuple(sorted(set(terminals), key=len, reverse=True))
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        return self._split(self._held + text, final=False)

    def finish(self) -> list[Piece]:
        return self._split(self._held, final=True)

    def _split(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (hit := self._first_terminal(text, pos)) is not None:
            start, terminal = hit
            if start > pos:
                pieces.append(Piece(text[pos:start], False))
            pieces.append(Piece(terminal, True))
            pos = start + len(terminal)
        rest = text[pos:]
        keep = 0 if final else self._undecided_tail(rest)
        if len(rest) > keep:
            pieces.append(Piece(rest[: len(rest) - keep], False))
        self._held = rest[len(rest) - keep :]
        return pieces

    def _first_terminal(self, text: str, pos: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for terminal in self._terminals:  # longest first, so ties keep the longer one
            start = text.find(terminal, pos)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, terminal)
        return best

    def _undecided_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some terminal."""
        longest = max((len(t) for t in self._terminals), default=0)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(t.startswith(tail) for t in self._terminals):
                return len(text) - start
        return 0
