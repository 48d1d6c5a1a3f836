"""Logprobs as the responses write them: the legacy completions shape (tokens, text offsets, top
alternatives), vLLM's prompt_logprobs, token labels, and the floor under -inf.

JSON has no -inf (the response encoder refuses it, the stream's encoder writes null), yet a token the
model rules out has that logprob: it is reported as -9999.0, as vLLM does.

A rank is a token's place in the model's distribution (1: the most likely). The engine reports each
position's top alternatives best first, so their ranks are known; a prompt token outside its
position's alternatives has rank null (the engine does not count the tokens above it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contract import TokenLogprob
from server.incremental_text import Decoder
from server.protocol import CompletionLogprobs, PromptLogprobs
from server.tokenizer import TextTokenizer

MIN_LOGPROB = -9999.0
# Byte-level tokens may hold the end of one character and the start of the next, so a run of tokens
# whose text ends inside a character lasts until a token ends on a character boundary; a run longer
# than this is byte noise (bytes that are no text), placed as it decodes alone.
MAX_PENDING_TOKENS = 16


def floored(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_label(tokenizer: TextTokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids,
    for tokens whose text is part of a character)."""
    return f"token_id:{token_id}" if as_id else tokenizer.token_text(token_id)


class TextOffsets:
    """Where each token's text begins in the text the response returns (OpenAI's text_offset), fed
    the tokens in order, from character `start` on: the offsets index the decoded text, not the
    tokens' lone texts. A special token the decoder skips has no text there (it begins where the next
    token does); a character split across byte-level tokens belongs to the token that completes it
    (the tokens before begin where it does)."""

    def __init__(self, decoder: Decoder, start: int = 0) -> None:
        self.decoder = decoder
        self._complete = start  # characters of the tokens before `_pending`
        self._pending: list[int] = []  # tokens whose text may end inside a character
        self._held = ""  # their text so far (ending in U+FFFD, the decoder's mark of an unfinished character)

    def push(self, token_ids: Sequence[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            self._pending.append(token_id)
            text = self.decoder.decode(self._pending)
            shared = _common_prefix_len(self._held, text)
            if self._held and text == self._held:  # its bytes join the unfinished character: it begins there
                shared -= 1
            offsets.append(self._complete + shared)
            if text.endswith("\ufffd") and len(self._pending) < MAX_PENDING_TOKENS:
                self._held = text
            else:
                self._complete, self._pending, self._held = self._complete + len(text), [], ""
        return offsets


def _common_prefix_len(a: str, b: str) -> int:
    """The characters of the earlier tokens' text (`a`) that the next token leaves as they were (`b`):
    an unfinished character it completes is not among them."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def legacy_logprobs(
    tokenizer: TextTokenizer, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
    offsets: Sequence[int], top: int, as_ids: bool = False,
) -> CompletionLogprobs:
    """The completions `logprobs` of `token_ids` (an entry None: no logprob, the prompt's first
    token); `offsets` from TextOffsets; at most `top` alternatives each (the chosen token alone when
    `top` is 0)."""
    result = CompletionLogprobs(text_offset=list(offsets))
    for token_id, entry in zip(token_ids, entries, strict=True):
        label = token_label(tokenizer, token_id, as_ids)
        result.tokens.append(label)
        result.token_logprobs.append(None if entry is None else floored(entry.logprob))
        alternatives = None
        if entry is not None:
            alternatives = {token_label(tokenizer, t, as_ids): floored(lp) for t, lp in entry.top[:top]}
            alternatives = alternatives or {label: floored(entry.logprob)}
        result.top_logprobs.append(alternatives)
    return result


def prompt_logprobs(
    tokenizer: TextTokenizer, entries: Sequence[TokenLogprob | None], prompt_ids: Sequence[int], top: int
) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token (None for the first) the token itself, then its
    position's `top` alternatives best first, keyed by id."""
    result: PromptLogprobs = []
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            result.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(entry.top, start=1)}
        position = {token_id: _logprob(tokenizer, token_id, entry.logprob, ranks.get(token_id))}
        for rank, (t, logprob) in enumerate(entry.top[:top], start=1):
            position.setdefault(t, _logprob(tokenizer, t, logprob, rank))
        result.append(position)
    return result


def _logprob(tokenizer: TextTokenizer, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": floored(logprob), "rank": rank, "decoded_token": tokenizer.token_text(token_id)}
