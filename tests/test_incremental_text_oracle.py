"""IncrementalText decodes a window of the last tokens; its deltas must be exactly those of decoding the
whole token list at every push (the oracle below, the former implementation), for random token streams:
multi-byte characters split across byte-level tokens, byte noise, special and added tokens, stop strings
that cross token boundaries, several tokens per push, and decoders that are not byte-level."""

from __future__ import annotations

import random

import pytest

from models.tiny import build_tokenizer
from server.completions import KeepSpecialTokens
from server.incremental_text import WINDOW_TOKENS, Decoder, IncrementalText
from server.tokenizer import TextTokenizer
from tests.serving import DSML_CALL

TEXTS = ["naïve café — 東京 😀 done", "Hello, world! ", "Ünïcödé ☃ ✓ 𝄞 ", "def main():\n    return 0\n",
         "数据 données データ ", "<think>why</think>answer"]


class WholeText:
    """The oracle: decodes every token so far at each push."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...], include_stop: bool) -> None:
        self.decoder, self.stop, self.include_stop = decoder, stop, include_stop
        self.token_ids: list[int] = []
        self.sent, self.stopped = "", False

    def push(self, token_ids: tuple[int, ...], final: bool) -> str:
        self.token_ids.extend(token_ids)
        text = self.decoder.decode(self.token_ids)
        cut = min(((i + len(s), i) for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            end, start = cut
            text, self.stopped = text[: end if self.include_stop else start], True
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                                          default=0)]
        delta, self.sent = text[len(self.sent):], text
        return delta


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    root = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(root / "tokenizer.json", extra_tokens=[*DSML_CALL, "東京", "😀"])
    return TextTokenizer(root, bos_token_id=0)


def token_stream(tokenizer: TextTokenizer, rng: random.Random) -> list[int]:
    """Pieces of encoded texts, byte noise (random ids) and special / added tokens, mixed."""
    ids: list[int] = []
    while len(ids) < rng.randrange(20, 120):
        kind = rng.random()
        if kind < 0.5:
            ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.8:
            ids += [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 6))]
        else:
            ids.append(rng.randrange(7) if rng.random() < 0.5 else rng.randrange(512, tokenizer.vocab_size))
    return ids


def stop_strings(text: str, rng: random.Random) -> tuple[str, ...]:
    """Up to three pieces of the text (so they cross token boundaries), sometimes one that never occurs."""
    stops = []
    for _ in range(rng.randrange(4)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start: start + rng.randrange(1, 8)])
        else:
            stops.append(rng.choice(["zzzq", "東京x", "\n\n\n", "done."]))
    return tuple(s for s in stops if s)


def pushes(ids: list[int], rng: random.Random) -> list[tuple[int, ...]]:
    """The ids cut into pushes of 1 to 3 tokens (a step may carry several: speculative decoding), now and
    then more than a window (merged steps) or none (an output without tokens)."""
    out, i = [], 0
    while i < len(ids):
        kind = rng.random()
        n = 1 if kind < 0.65 else 0 if kind < 0.75 else rng.randrange(WINDOW_TOKENS, 2 * WINDOW_TOKENS) if kind < 0.8 \
            else rng.randrange(2, 4)
        out.append(tuple(ids[i: i + n]))
        i += n
    return out


def check_same(decoder: Decoder, ids: list[int], stop: tuple[str, ...], include_stop: bool, rng: random.Random,
               prefix_stable: bool = True) -> None:
    """Same deltas push by push; `sent` is what the deltas add up to (for a decoder that rewrites earlier
    text, the oracle's `sent` is the last decode instead, which no client saw)."""
    fast, oracle = IncrementalText(decoder, stop, include_stop), WholeText(decoder, stop, include_stop)
    steps, deltas = pushes(ids, rng), []
    for n, step in enumerate(steps):
        final = n == len(steps) - 1
        deltas.append(oracle.push(step, final))
        assert fast.push(step, final) == deltas[-1], (ids, stop, n)
        assert fast.stopped == oracle.stopped
        if oracle.stopped:
            break
    assert fast.sent == "".join(deltas)
    if prefix_stable:
        assert fast.sent == oracle.sent
        if not stop:
            assert fast.sent == decoder.decode(ids)


@pytest.mark.parametrize("keep_special", [False, True])
def test_deltas_equal_the_whole_decode_for_random_streams(tokenizer, keep_special):
    decoder = KeepSpecialTokens(tokenizer) if keep_special else tokenizer
    rng = random.Random(7 + keep_special)
    for _ in range(150):
        ids = token_stream(tokenizer, rng)
        stop = stop_strings(decoder.decode(ids), rng) if rng.random() < 0.7 else ()
        check_same(decoder, ids, stop, rng.random() < 0.3, rng)


def test_long_streams_move_the_window_and_stay_exact(tokenizer):
    rng = random.Random(3)
    ids = token_stream(tokenizer, rng) * 10
    assert len(ids) > 10 * WINDOW_TOKENS
    check_same(tokenizer, ids, (), False, rng)
    check_same(KeepSpecialTokens(tokenizer), ids, ("zzzq", "😀 d"), False, rng)


class FirstSpaceDropped:
    """Like SentencePiece's Metaspace: a list's first token loses its leading space."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids)).removeprefix(" ")


class Ligatures:
    """Not prefix-stable: "fi" decodes to one character, so a longer list rewrites earlier text."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids)).replace("fi", "\ufb01")


def test_a_decoder_that_drops_a_first_space_gives_the_whole_decode_deltas():
    rng = random.Random(5)
    for _ in range(100):
        ids = [ord(c) for c in rng.choices(" fiab", k=rng.randrange(1, 60))]
        stop = stop_strings(FirstSpaceDropped().decode(ids), rng) if rng.random() < 0.5 else ()
        check_same(FirstSpaceDropped(), ids, stop, rng.random() < 0.3, rng)


def test_a_push_without_tokens_after_a_long_one_keeps_the_window_context():
    """A long push moves the window's start; an empty push next must not move it past every token, or the
    next token would be the window's first and lose its space."""
    decoder, long = FirstSpaceDropped(), tuple(map(ord, "ab " * (WINDOW_TOKENS // 2 + 1)))
    fast, oracle = IncrementalText(decoder), WholeText(decoder, (), False)
    steps = [(97,), long, long, (), (32,), (120,)]
    for n, step in enumerate(steps):
        assert fast.push(step, n == len(steps) - 1) == oracle.push(step, n == len(steps) - 1), n
    assert fast.sent == oracle.sent == decoder.decode([t for step in steps for t in step])


def test_a_decoder_that_rewrites_earlier_text_gives_the_whole_decode_deltas():
    """Read from the first token on once its window text stops extending the text before (stop strings
    are then looked for in the new text only: no byte-level BPE rewrites what it decoded)."""
    rng = random.Random(6)
    for _ in range(100):
        ids = [ord(c) for c in rng.choices(" fiab", k=rng.randrange(1, 60))]
        check_same(Ligatures(), ids, (), False, rng, prefix_stable=False)
