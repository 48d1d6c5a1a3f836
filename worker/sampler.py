"""Token sampling and logprobs from one step's logits, all the step's sampling rows at once.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as vLLM and
OpenAI report them: the masks (allowed_token_ids, bad_words, the grammar's token bitmask), logit_bias,
the min_tokens ban and the presence / frequency / repetition penalties change only what is drawn
(greedy's argmax included: the best token the masks leave), as temperature / top-k / top-p / min-p
do. One difference from vLLM: it applies the grammar's bitmask before its sampler, so its logprobs of
a structured request are the masked distribution's; here they stay the model's, as for every other
mask. Greedy takes the argmax (lowest id among equal maxima). A seeded request draws from its own
generator, keyed by seed and draw index, so its tokens do not depend on what else shares the batch.

`sample_rows` draws a step's rows together: each parameter becomes one tensor across the rows that
use it (masks, biases, bans, penalties, temperature, top-k, min-p, top-p), so a step costs a fixed
number of kernels and host reads whatever its batch. A step whose rows are all plain
(`DrawRow.plain`: greedy, nothing reshapes the logits, no top logprobs: the common decode step) takes
one argmax and nothing else. Two things stay per row, both so that a row's token depends
on that row alone:
- a seeded row's draw, from its own generator; unseeded rows draw together from one generator.
- top-p's cumulative sum: CUDA scans a lone row with another algorithm than the rows of a batch (a
  different rounding), so one scan over the batch would make a seeded row's nucleus depend on it.
Every other step is exact per element or reduces within a row, so each row comes out bitwise as
`sample` gives it alone (tests/test_sampling.py checks it against the per-row reference).

Rows are independent draws with their own draw index, so a multi-token step (drafts to verify, a
later issue) can put several rows of one request into one call.

`draw_rows` leaves the step's draws on the device (`Draws`), their copy to the host started without
waiting (pinned memory, an event), so that overlapped scheduling can launch the next step, whose
decode inputs are these tokens (PENDING_TOKEN), before the host reads them (`Draws.read`). Unseeded rows
draw from a generator seeded by the plan's `draw_seed` when it has one, so every tensor-parallel rank
draws the same tokens; its parameter tensors reach the device without blocking (models/transfer.py).

A row that cannot be drawn (its raw logits, its adjusted logits or its filtered distribution are not
finite: NaN, +inf, or every token excluded) comes back as None, so that its request fails alone
(worker/runner.py) and the step goes on: a NaN probability would make the batch's multinomial raise
(on CUDA, a device assert that ends the process). Such a row's draw is replaced by token 0's before
any draw kernel sees it, and as every step is per row, the other rows' tokens stay bitwise what they
are without it. Checking costs no host read: a row that cannot be drawn reports a NaN logprob, which
the one read of the chosen logprobs already brings back (a raw row with NaN or inf anywhere has NaN
or inf as its chosen logprob by itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from contract import SamplingParams, TokenLogprob
from kernels import stable_topk
from kernels.argmax import argmax_logprob
from models.transfer import on_device

# why a row that comes back as None fails its request (the client reads it)
NOT_DRAWABLE = ("the next token cannot be sampled: the logits, or the distribution the sampling parameters "
                "make of them, are not finite (NaN or infinite), or the parameters and the grammar exclude "
                "every token")


@dataclass(frozen=True)
class DrawRow:
    """One row to draw: its params, its draw index (output tokens before this draw: it keys a seeded
    generator and the min_tokens ban), the token histories its penalties and multi-id bad words read
    (empty unless `params.penalizes_output`: the scheduler fills them only then) and the grammar's
    token bitmask for this draw (ScheduledChunk.token_bitmask; empty: any token)."""

    params: SamplingParams
    draw_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    token_bitmask: Sequence[int] = ()

    @property
    def plain(self) -> bool:
        """The draw is the raw argmax (`SamplingParams.plain_at`). The bitmask is the chunk's, not the
        params', so it is checked here too: a row given one is masked whatever its params say."""
        return self.params.plain_at(self.draw_index) and not self.token_bitmask

    @property
    def reshaped(self) -> bool:
        """Something changes the logits this draw sees (`SamplingParams.reshapes_at`, or a bitmask)."""
        return self.params.reshapes_at(self.draw_index) or bool(self.token_bitmask)


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int | None) -> TokenLogprob:
    """logprobs: [vocab] log-softmax row."""
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        values, ids = stable_topk(logprobs, top_n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top_n: int | None) -> tuple[TokenLogprob, ...]:
    """logits [>= len(targets), vocab]: row i's logprob of targets[i] (echo: the prompt token after it)."""
    return tuple(token_logprobs(torch.log_softmax(logits[i], -1), target, top_n) for i, target in enumerate(targets))


def sample(
    logits: torch.Tensor, params: SamplingParams, draw_index: int,
    prompt_token_ids: Sequence[int] = (), output_token_ids: Sequence[int] = (), token_bitmask: Sequence[int] = (),
) -> TokenLogprob | None:
    """logits: [vocab] float32 row for one sequence; draw_index: output tokens so far. The token
    histories are needed only when `params` penalizes output (penalties, multi-id bad words); the
    returned logprobs are the raw logits' log-softmax whatever shaped the draw. None: the row cannot be
    drawn (see the module docstring)."""
    row = DrawRow(params, draw_index, prompt_token_ids, output_token_ids, token_bitmask)
    return sample_rows(logits[None], [row])[0]


def sample_rows(logits: torch.Tensor, rows: Sequence[DrawRow], seed: int = 0) -> list[TokenLogprob | None]:
    """logits [n, vocab] float32, row i drawn as rows[i] asks -> each row's token and logprobs, or None
    for a row whose logits or distribution are not finite (its request fails; the others are drawn)."""
    return draw_rows(logits, rows, seed).read()


@dataclass
class Draws:
    """A step's draws on the device, on their way to the host: `tokens` [n] feeds the next step's
    pending inputs; `read` waits for the copy and reports each row (None: not drawable)."""

    tokens: torch.Tensor  # [n] int64
    chosen: torch.Tensor  # [n] float32: each token's raw logprob, NaN where the row could not be drawn
    top_n: list[int]  # per row: top logprobs asked (0: none)
    top_values: torch.Tensor | None = None  # [rows asking, max top_n] of those rows, in row order
    top_ids: torch.Tensor | None = None
    _host: list[torch.Tensor] = field(default_factory=list)
    _ready: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.tokens, self.chosen, self.top_values, self.top_ids) if t is not None]

    def copy_out(self) -> None:
        """Starts the copy to the host (pinned, in stream order) without waiting for it."""
        if self.tokens.device.type != "cuda":
            return
        self._host = [t.to("cpu", non_blocking=True) for t in self._tensors()]
        self._ready = torch.cuda.Event()
        self._ready.record()

    def read(self) -> list[TokenLogprob | None]:
        if self._ready is not None:
            self._ready.synchronize()
            tokens, chosen, *tops = self._host
        else:
            tokens, chosen, *tops = self._tensors()
        top_rows = iter(zip(tops[1].tolist(), tops[0].tolist())) if tops else iter(())
        reported: list[TokenLogprob | None] = []
        for token, logprob, top_n in zip(tokens.tolist(), chosen.tolist(), self.top_n):
            top = ()
            if top_n:
                ids, values = next(top_rows)
                top = tuple(zip(ids[:top_n], values[:top_n]))
            reported.append(TokenLogprob(token_id=token, logprob=logprob, top=top) if math.isfinite(logprob) else None)
        return reported


def draw_rows(logits: torch.Tensor, rows: Sequence[DrawRow], seed: int = 0) -> Draws:
    """`sample_rows`' draws, left on the device; `seed` (nonzero) seeds the unseeded rows' generator."""
    top_n = [row.params.logprobs or 0 for row in rows]
    if all(row.plain and not row.params.logprobs for row in rows):  # greedy, nothing but the chosen logprob
        tokens, chosen = argmax_logprob(logits)  # a NaN / inf row shows in its chosen logprob
        return Draws(tokens, chosen, top_n)
    logprobs = torch.log_softmax(logits, dim=-1)
    if all(row.plain for row in rows):
        tokens, drawable = torch.argmax(logits, dim=-1), None  # a NaN / inf row shows in its chosen logprob
    else:
        tokens, drawable = _draw(_adjusted(logits, rows), rows, seed)
    return _reported(logprobs, tokens, drawable, top_n)


def _adjusted(logits: torch.Tensor, rows: Sequence[DrawRow]) -> torch.Tensor:
    """The logits the draws use, in vLLM's order: the masks (grammar bitmask, allowed_token_ids,
    bad_words), logit_bias, the min_tokens ban, then penalties. Each touches only the rows that ask for
    it; the others keep their logits bit for bit. A masked token stays -inf through the later steps
    (a finite bias, a positive penalty factor or a finite subtraction leave -inf as it is). With no row
    reshaped, the raw logits themselves (read only after this: no copy)."""
    if not any(row.reshaped for row in rows):
        return logits
    logits = logits.clone()
    _mask_bitmask(logits, rows)
    _allow_only(logits, rows)
    _exclude(logits, [(i, token) for i, row in enumerate(rows)
                      for token in row.params.bad_word_bans(row.output_token_ids)])
    _add_bias(logits, rows)
    _exclude(logits, [(i, token) for i, row in enumerate(rows) for token in row.params.banned_at(row.draw_index)])
    _penalize_repeats(logits, rows)
    _penalize_counts(logits, rows)
    return logits


def _mask_bitmask(logits: torch.Tensor, rows: Sequence[DrawRow]) -> None:
    """The grammar's bitmasks (xgrammar's layout: token t is bit t % 32 of int32 word t // 32), all
    rows' words unpacked at once on the logits' device. Words past the vocabulary's are ignored and
    tokens past the row's words are excluded (missing words count as zeros)."""
    index = [i for i, row in enumerate(rows) if row.token_bitmask]
    if not index:
        return
    vocab = logits.shape[-1]
    width = -(-vocab // 32)  # the words that cover the vocabulary
    padded = [[*mask[:width], *[0] * (width - len(mask))] for mask in (rows[i].token_bitmask for i in index)]
    words = on_device(padded, torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(index), width * 32)[:, :vocab].bool()
    at = _index(logits, index)
    logits[at] = logits[at].masked_fill(~allowed, float("-inf"))


def _allow_only(logits: torch.Tensor, rows: Sequence[DrawRow]) -> None:
    """allowed_token_ids: every other token of the rows that set it is excluded."""
    index = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not index:
        return
    allowed = torch.zeros(len(index), logits.shape[-1], dtype=torch.bool, device=logits.device)
    entries = [(j, token) for j, i in enumerate(index) for token in rows[i].params.allowed_token_ids]
    allowed[_at(logits, *zip(*entries))] = True
    at = _index(logits, index)
    logits[at] = logits[at].masked_fill(~allowed, float("-inf"))


def _add_bias(logits: torch.Tensor, rows: Sequence[DrawRow]) -> None:
    entries = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.params.logit_bias]
    if entries:
        index, tokens, biases = zip(*entries)
        logits.index_put_(_at(logits, index, tokens), _floats(logits, biases), accumulate=True)


def _exclude(logits: torch.Tensor, entries: Sequence[tuple[int, int]]) -> None:
    """(row, token) entries set to -inf in one scatter: bad words' bans, the min_tokens ban."""
    if entries:
        index, tokens = zip(*entries)
        logits[_at(logits, index, tokens)] = float("-inf")


def _penalize_repeats(logits: torch.Tensor, rows: Sequence[DrawRow]) -> None:
    """The repetition penalty over prompt + output tokens: positive logits divided, negative multiplied."""
    index = [i for i, row in enumerate(rows) if row.params.penalizes_prompt]
    if not index:
        return
    seen_at = [(j, t) for j, i in enumerate(index) for t in (*rows[i].prompt_token_ids, *rows[i].output_token_ids)]
    at = _index(logits, index)
    picked = logits[at]
    seen = torch.zeros_like(picked, dtype=torch.bool)
    if seen_at:
        seen[_at(logits, *zip(*seen_at))] = True
    penalty = _floats(logits, [rows[i].params.repetition_penalty for i in index])[:, None]
    penalized = torch.where(picked > 0, picked / penalty, picked * penalty)
    logits[at] = torch.where(seen, penalized, picked)


def _penalize_counts(logits: torch.Tensor, rows: Sequence[DrawRow]) -> None:
    """Frequency (per occurrence) and presence (once) penalties over the generated tokens only."""
    index = [i for i, row in enumerate(rows)
             if row.output_token_ids and (row.params.frequency_penalty or row.params.presence_penalty)]
    if not index:
        return
    seen_at = [(j, t) for j, i in enumerate(index) for t in rows[i].output_token_ids]
    counts = torch.zeros(len(index), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    counts.index_put_(_at(logits, *zip(*seen_at)), torch.ones(len(seen_at), dtype=logits.dtype, device=logits.device),
                      accumulate=True)
    frequency = _floats(logits, [rows[i].params.frequency_penalty for i in index])[:, None]
    presence = _floats(logits, [rows[i].params.presence_penalty for i in index])[:, None]
    at = _index(logits, index)
    logits[at] = logits[at] - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def _draw(adjusted: torch.Tensor, rows: Sequence[DrawRow], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token (greedy rows the argmax, the others a draw from their filtered distribution)
    and whether it could be drawn. A greedy row's argmax lands on a NaN or +inf if it has one (or on
    -inf if every token is), so its chosen logit is finite exactly when the row is usable; a drawn row
    needs every probability finite, and one that has not draws from token 0's one-hot instead."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not greedy and all(row.params.seed is None for row in rows):  # the common sampled step: no row indexing
        probs = _drawable_probs(_filtered(adjusted, [row.params for row in rows]).softmax(-1))
        return torch.multinomial(probs.probs, 1, generator=_step_generator(probs.probs.device, seed))[:, 0], probs.finite
    tokens = torch.empty(len(rows), dtype=torch.long, device=adjusted.device)
    drawable = torch.empty(len(rows), dtype=torch.bool, device=adjusted.device)
    if greedy:
        at = _index(adjusted, greedy)
        picked = adjusted[at]
        best = torch.argmax(picked, dim=-1)
        tokens[at] = best
        drawable[at] = torch.isfinite(picked.gather(1, best[:, None])[:, 0])
    if drawn:
        at = _index(adjusted, drawn)
        drawable_probs = _drawable_probs(_filtered(adjusted[at], [rows[i].params for i in drawn]).softmax(-1))
        drawable[at] = drawable_probs.finite
        probs = drawable_probs.probs
        unseeded = []
        for j, i in enumerate(drawn):
            params = rows[i].params
            if params.seed is None:
                unseeded.append(j)
            else:
                generator = _seeded(probs.device, params.seed, rows[i].draw_index)
                tokens[i] = torch.multinomial(probs[j], 1, generator=generator)[0]
        if unseeded:
            generator = _step_generator(probs.device, seed)
            picked = probs if len(unseeded) == len(drawn) else probs[_index(probs, unseeded)]
            tokens[_index(tokens, [drawn[j] for j in unseeded])] = torch.multinomial(picked, 1, generator=generator)[:, 0]
    return tokens, drawable


class DrawableProbs(NamedTuple):
    """A step's filtered distributions, with the rows that are not finite replaced by token 0's one-hot
    (`finite` False there) so that no draw kernel sees a NaN."""

    probs: torch.Tensor
    finite: torch.Tensor


_FIRST_TOKEN: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _drawable_probs(probs: torch.Tensor) -> DrawableProbs:
    finite = torch.isfinite(probs).all(dim=-1)
    key = (probs.device, probs.dtype, probs.shape[-1])
    if key not in _FIRST_TOKEN:  # token 0's one-hot row, made once per device and vocabulary
        _FIRST_TOKEN[key] = torch.zeros(1, probs.shape[-1], dtype=probs.dtype, device=probs.device)
        _FIRST_TOKEN[key][0, 0] = 1.0
    return DrawableProbs(torch.where(finite[:, None], probs, _FIRST_TOKEN[key]), finite)


def _step_generator(device: torch.device, seed: int) -> torch.Generator:
    """The unseeded rows' generator: seeded by the plan's draw seed when it has one, else fresh."""
    generator = torch.Generator(device=device)
    if seed:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator


def _seeded(device: torch.device, seed: int, draw_index: int) -> torch.Generator:
    """The generator of one seeded draw: keyed by (seed, draw index), so the draw is the same whatever
    came before it in this process or shares its step."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + draw_index) % (1 << 63))  # any seed fits the generator
    return generator


def _filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p, each over the rows that set it."""
    logits = logits / _floats(logits, [p.temperature for p in params])[:, None]
    vocab = logits.shape[-1]
    top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        at = _index(logits, top_k)
        picked = logits[at]
        ranks = on_device([params[j].top_k - 1 for j in top_k], torch.long, logits.device)[:, None]
        kth = torch.sort(picked, dim=-1, descending=True).values.gather(1, ranks)
        logits[at] = picked.masked_fill(picked < kth, float("-inf"))
    min_p = [j for j, p in enumerate(params) if p.min_p > 0]
    if min_p:
        at = _index(logits, min_p)
        picked = logits[at]
        probs = picked.softmax(-1)
        floor = _floats(logits, [params[j].min_p for j in min_p])[:, None] * probs.max(dim=-1, keepdim=True).values
        logits[at] = picked.masked_fill(probs < floor, float("-inf"))
    top_p = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        at = _index(logits, top_p)
        picked = logits[at]
        sorted_probs, order = torch.sort(picked.softmax(-1), dim=-1, descending=True, stable=True)
        before = torch.stack([row.cumsum(-1) for row in sorted_probs]) - sorted_probs  # per row: see the docstring
        outside = before > _floats(logits, [params[j].top_p for j in top_p])[:, None]
        logits[at] = picked.masked_fill(torch.zeros_like(outside).scatter(1, order, outside), float("-inf"))
    return logits


def _reported(logprobs: torch.Tensor, tokens: torch.Tensor, drawable: torch.Tensor | None, top_n: list[int]) -> Draws:
    """Each row's token with its raw logprob and, where asked, its top-N (three host reads a step,
    when the draws are read). A row that could not be drawn, or whose raw logits are not finite, has a
    non-finite chosen logprob and reads as None."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    if drawable is not None:
        chosen = torch.where(drawable, chosen, math.nan)
    wanted = [i for i, n in enumerate(top_n) if n]
    if not wanted:
        return Draws(tokens, chosen, top_n)
    values, ids = stable_topk(logprobs if len(wanted) == len(top_n) else logprobs[_index(logprobs, wanted)], max(top_n))
    return Draws(tokens, chosen, top_n, values, ids)


def _index(like: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Row indices on `like`'s device (indexing with a list would copy them there blocking)."""
    return on_device(rows, torch.long, like.device)


def _at(like: torch.Tensor, rows: Sequence[int], columns: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors on `like`'s device."""
    return on_device(rows, torch.long, like.device), on_device(columns, torch.long, like.device)


def _floats(like: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    """One parameter across rows, in `like`'s dtype: the value each row's scalar would have become."""
    return on_device(values, like.dtype, like.device)
