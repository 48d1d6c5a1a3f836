"""The synthetic long-context task of the tiny default model: key-value recall in stdlib code.

A sample is stdlib code (a window of a token stream) with a few assignment lines buried in it at
random depths, `NAME = 'VALUE'` (names and values drawn from word lists, each line after a newline of
the code), and at its end the start of one of those lines again, `NAME = '`: the answer is `VALUE'`
(an induction copy: find the earlier line that starts the same, go on as it did). Beyond the sliding
window the value can only come back through the compressed caches and the indexers' top-k, which is
what the task exercises. Training samples end with a query line for every needle, answers
included, and say which rows predict an answer token; evaluation prompts end at one query's opening
quote, and `needle_accuracy` generates greedily through the serving forward (`DeepseekV41.forward`
with a paged cache: a prefill, then one decode token per step), scoring an exact match of the answer.
Everything is drawn from a numpy Generator, so a seed fixes the samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models import ForwardBatch, ModelCache

NAME_WORDS = (
    "amber", "brisk", "cedar", "delta", "ember", "fable", "glade", "harbor", "ivory", "jolly", "kernel", "lunar",
    "maple", "noble", "orbit", "pixel", "quartz", "raven", "solar", "tidal", "umber", "vivid", "willow", "xenon",
    "yonder", "zephyr", "copper", "marble", "silver", "velvet", "crimson", "meadow",
)
VALUE_WORDS = (
    "apple", "bridge", "candle", "dragon", "engine", "forest", "garden", "hammer", "island", "jacket", "kitten",
    "lantern", "mirror", "needle", "orange", "pepper", "rocket", "saddle", "tunnel", "violin", "wagon", "yellow",
    "button", "carpet", "dinner", "falcon", "ginger", "helmet", "magnet", "pillow", "ribbon", "tomato",
)


@dataclass(frozen=True)
class NeedleSample:
    tokens: list[int]  # BOS, the code with the needles, the query line(s)
    answers: tuple[str, ...]  # per query, the text that must follow it: VALUE'
    answer_rows: tuple[int, ...] = ()  # rows whose next token is an answer token (training samples)


class NeedleTask:
    """Samples over `filler` (a token stream of stdlib code) with `tokenizer`'s ids."""

    def __init__(self, tokenizer, filler: np.ndarray, bos_id: int, needles: int = 4) -> None:
        self.tokenizer, self.filler, self.bos, self.needles = tokenizer, filler, bos_id, needles
        self.newline = self._encode("\n")
        assert len(self.newline) == 1, "the tokenizer must give a newline one id"

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _pairs(self, rng: np.random.Generator, taken: set[int]) -> list[tuple[str, str]]:
        """The needles' (name, value) pairs, names not in `taken` (name codes; the drawn ones are added)."""
        free = [code for code in range(len(NAME_WORDS) ** 2) if code not in taken]
        out = []
        for code in (free[i] for i in rng.choice(len(free), size=self.needles, replace=False).tolist()):
            taken.add(code)
            name = f"{NAME_WORDS[code // len(NAME_WORDS)]}_{NAME_WORDS[code % len(NAME_WORDS)]}"
            value = f"{VALUE_WORDS[int(rng.integers(len(VALUE_WORDS)))]}-{int(rng.integers(10, 100))}"
            out.append((name, value))
        return out

    def sample(self, rng: np.random.Generator, length: int, train: bool, taken: set[int] | None = None) -> NeedleSample:
        """A sample of exactly `length` tokens: a training sample (every needle queried, answers in
        it) or an evaluation prompt (one query, no answer). `taken`: names not to use (see `_pairs`)."""
        pairs = self._pairs(rng, set() if taken is None else taken)
        needles = [self._encode(f"{name} = '{value}'\n") for name, value in pairs]
        asked = [int(i) for i in rng.permutation(len(pairs))] if train else [int(rng.integers(len(pairs)))]
        tail: list[int] = list(self.newline)
        answer_rows: list[int] = []
        for i in asked:
            name, value = pairs[i]
            tail += self._encode(f"{name} = '")
            if train:
                answer = self._encode(f"{value}'\n")
                answer_rows += [len(tail) - 1 + j for j in range(len(answer))]  # relative to the tail for now
                tail += answer
        n_filler = length - 1 - len(tail) - sum(len(n) for n in needles)
        if n_filler < 8 * len(needles):
            raise ValueError(f"a needle sample of {length} tokens has no room for its filler")
        start = int(rng.integers(0, len(self.filler) - n_filler))
        code = self.filler[start : start + n_filler].tolist()
        code = self._bury(rng, code, needles)
        tokens = [self.bos] + code + tail
        offset = 1 + len(code)
        answers = tuple(f"{pairs[i][1]}'" for i in asked)
        return NeedleSample(tokens, answers, tuple(offset + r for r in answer_rows))

    def _bury(self, rng: np.random.Generator, code: list[int], needles: list[list[int]]) -> list[int]:
        """The needles put in after newlines of the code at random depths (anywhere if it has too few)."""
        newline = self.newline[0]
        candidates = [i + 1 for i, t in enumerate(code) if t == newline]
        if len(candidates) < len(needles):
            candidates = list(range(len(code)))
            needles = [self.newline + n for n in needles]
        places = sorted(rng.choice(candidates, size=len(needles), replace=False).tolist())
        out, last = [], 0
        for place, needle in zip(places, needles):
            out += code[last:place] + needle
            last = place
        return out + code[last:]


def packed(task: NeedleTask, rng: np.random.Generator, lengths: list[int], separator: int) -> NeedleSample:
    """Training samples of `lengths` tokens back to back in one sequence (each after the first starting
    with `separator` instead of BOS, as files follow each other in the corpus stream), no name used twice:
    one sequence teaches as many recalls as its samples hold, at the cost of one."""
    tokens: list[int] = []
    answers: list[str] = []
    rows: list[int] = []
    taken: set[int] = set()
    for length in lengths:
        sample = task.sample(rng, length, train=True, taken=taken)
        rows += [len(tokens) + r for r in sample.answer_rows]
        tokens += sample.tokens if not tokens else [separator] + sample.tokens[1:]
        answers += sample.answers
    return NeedleSample(tokens, tuple(answers), tuple(rows))


def answer_matches(text: str, answer: str) -> bool:
    """Exact match: the generated text starts with the answer (the value and its closing quote)."""
    return text.startswith(answer)


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], new_tokens: int, batch_size: int = 8) -> list[list[int]]:
    """Greedy continuations of `prompts` through the serving forward: each batch of prompts prefilled in
    one step (a chunk per slot of a fresh paged cache), then one token per sequence per step."""
    device = model.lm_head.weight.device
    out: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        group = prompts[first : first + batch_size]
        longest = max(len(p) for p in group) + new_tokens
        cache = ModelCache.allocate(model.config, len(group), longest, device=device)
        logits = model(ForwardBatch.build([(slot, p, 0) for slot, p in enumerate(group)]), cache)
        generated = [[int(t)] for t in logits.argmax(-1).tolist()]
        for step in range(1, new_tokens):
            batch = ForwardBatch.build(
                [(slot, [g[-1]], len(p) + step - 1) for slot, (p, g) in enumerate(zip(group, generated))]
            )
            for g, token in zip(generated, model(batch, cache).argmax(-1).tolist()):
                g.append(int(token))
        out += generated
    return out


def needle_accuracy(model, task: NeedleTask, length: int, samples: int, seed: int, batch_size: int = 8) -> float:
    """Exact-match accuracy of greedy answers over `samples` prompts of `length` tokens, the answer's
    tokens and two more generated after each (all within `length` + that)."""
    rng = np.random.default_rng(seed)
    drawn = [task.sample(rng, length, train=False) for _ in range(samples)]
    budget = max(len(task._encode(s.answers[0])) for s in drawn) + 2
    generated = greedy_generate(model, [s.tokens for s in drawn], budget, batch_size)
    hits = [answer_matches(task.tokenizer.decode(g), s.answers[0]) for g, s in zip(generated, drawn)]
    return sum(hits) / len(hits)
