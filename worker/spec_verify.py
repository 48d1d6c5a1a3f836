"""Verifying draft tokens against the target model's distributions (speculative decoding, issue 27).

A verify step runs the target model once over each request's last token and its K drafts, which gives
K + 1 distributions per request: position i is the target's next-token distribution after the
prefix with drafts 0 .. i - 1. From them a request emits its accepted drafts and one more token, so
the output is distributed exactly as drawing one token at a time from the target:

- `verify_greedy`: greedy requests accept drafts while each equals the target's argmax at its position;
  the next token is the argmax where the first draft differs (or after the last: the bonus token).
  Exactly the tokens plain greedy decoding gives.
- `verify_sampled`: rejection sampling (Leviathan et al. 2023, Chen et al. 2023; vLLM's standard
  method). Draft i, drawn from the draft distribution q_i, is accepted with probability
  min(1, p_i(x) / q_i(x)); at the first rejection the token is drawn from the recovered distribution
  norm(max(p_i - q_i, 0)), and when every draft is accepted a bonus token from p_K. A proposer that
  gives no distribution (a draft chosen by argmax) is a one-hot q: draft x is accepted with
  probability p_i(x), and the recovered distribution is p_i without x.
- `verify_block`: block verification (Sun et al. 2024, "Block Verification Accelerates Speculative
  Decoding"), the same output distribution with at least as many drafts accepted on average: the
  drafts are judged as a block, keeping a weight w_i = min(1, w_(i-1) p_i(x_i) / q_i(x_i)) of how far
  the prefix is still consistent with the target, and the accepted prefix is the longest one whose
  own coin passes (so a failed check can be overruled by a later prefix), then one token from the
  residual max(w p - q, 0) at the position after it (the target's own after the last draft).

Both work on a batch of requests padded to the step's widest K (`lengths`: each request's own),
as tensors, with one host read of the results. `p` here is the distribution the request's sampling
parameters make of the logits (worker/sampler.py's temperature, top-k / top-p / min-p, masks and
penalties), not the raw softmax: the output must follow what plain sampling would draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """One request's outcome: `accepted` drafts kept, then `tokens` = those drafts and one token the
    target gave (recovered at the first rejection, or the bonus after the last draft)."""

    tokens: tuple[int, ...]
    accepted: int


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor) -> list[Verified]:
    """target_logits [R, K + 1, V] (any monotone transform of the adjusted logits: the argmax is what
    counts, the lowest id among equal maxima), drafts [R, K] int64, lengths [R] drafts per request."""
    best = torch.argmax(target_logits, dim=-1)  # [R, K + 1]
    matches = (drafts == best[:, :-1]) & _within(drafts, lengths)
    accepted = _leading(matches)
    last = best.gather(1, accepted[:, None])[:, 0]
    return _outcomes(drafts, accepted, last)


def verify_sampled(
    target_probs: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[Verified]:
    """target_probs [R, K + 1, V] (each row a distribution), drafts [R, K] drawn from draft_probs
    [R, K, V] (None: drafts chosen without a distribution, a one-hot q), lengths [R]. Every random
    number comes from `generator` (R x K uniforms, then one draw a request)."""
    rows, width = drafts.shape
    p_k = target_probs[:, :width]
    p_draft = p_k.gather(2, drafts[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p_k.scatter(2, drafts[..., None], 0.0)  # max(p - onehot, 0): p without the draft
    else:
        q_draft = draft_probs.gather(2, drafts[..., None])[..., 0]
        residual = (p_k - draft_probs).clamp(min=0.0)
    uniform = torch.rand(rows, width, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    # accept with probability min(1, p / q): u < p / q, written without the division (q > 0 for a draft
    # drawn from q; a q of 0 would accept whatever u is, as u < inf)
    accepted = _leading((uniform * q_draft < p_draft) & _within(drafts, lengths))
    # the distribution of the token after the accepted drafts: recovered where a draft was rejected,
    # the target's own at the bonus position
    rejected = accepted < lengths
    at = accepted.clamp(max=width - 1)[:, None, None].expand(-1, 1, target_probs.shape[-1])
    recovered = residual.gather(1, at)[:, 0] if width else target_probs[:, 0]
    bonus = target_probs.gather(1, accepted[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    # a recovered distribution that rounds to all zeros (p and q equal to the last bit) falls back to p
    usable = recovered.sum(dim=-1, keepdim=True) > 0
    last_probs = torch.where(rejected[:, None] & usable, recovered, bonus)
    last = torch.multinomial(last_probs, 1, generator=generator)[:, 0]
    return _outcomes(drafts, accepted, last)


def verify_block(
    target_probs: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[Verified]:
    """`verify_sampled`'s contract by block verification. With prefix weights w_0 = 1,
    w_i = min(1, w_(i-1) p_(i-1)(x_(i-1)) / q_(i-1)(x_(i-1))) (0-based drafts x_j at positions j) and
    residual masses rho_i = sum_x max(w_i p_i(x) - q_i(x), 0), prefix i of a request with L drafts
    passes its coin with probability h_i = rho_i / (rho_i + 1 - w_i) for 0 < i < L (1 where both are 0)
    and h_L = w_L; the longest passing prefix is kept (none: 0), then a token from
    norm(max(w_t p_t - q_t, 0)) at its end t, or from p_L after every draft."""
    rows, width = drafts.shape
    vocab = target_probs.shape[-1]
    p_k = target_probs[:, :width]
    if draft_probs is None:
        draft_probs = torch.zeros_like(p_k).scatter(2, drafts[..., None], 1.0)
    ratio = p_k.gather(2, drafts[..., None])[..., 0] / draft_probs.gather(2, drafts[..., None])[..., 0]
    weights = [torch.ones(rows, dtype=target_probs.dtype, device=target_probs.device)]
    for j in range(width):  # a scan over the (few) draft positions
        weights.append(torch.minimum(weights[-1] * ratio[:, j], torch.ones_like(ratio[:, j])))
    weight = torch.stack(weights, dim=1)  # [R, K + 1]: w_0 .. w_K
    residual = (weight[:, :width, None] * p_k - draft_probs).clamp(min=0.0)  # at positions 0 .. K - 1
    mass = residual.sum(dim=-1)
    spare = 1.0 - weight[:, :width]
    passes = torch.where(mass + spare > 0, mass / (mass + spare), torch.ones_like(mass))  # h_0 .. h_(K-1)
    # h_L = w_L: the last prefix of each request passes with its weight
    last = torch.arange(width + 1, device=drafts.device)[None, :] == lengths[:, None]
    h = torch.where(last, weight, torch.cat([passes, torch.zeros_like(passes[:, :1])], dim=1))
    uniform = torch.rand(rows, width, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    coin = torch.cat([torch.zeros_like(uniform[:, :1]), uniform], dim=1) <= h  # prefix 0 always passes
    coin &= torch.arange(width + 1, device=drafts.device)[None, :] <= lengths[:, None]
    kept = width - torch.argmax(coin.flip(1).to(torch.int8), dim=1)  # the longest passing prefix
    at = kept.clamp(max=max(width - 1, 0))[:, None, None].expand(-1, 1, vocab)
    recovered = residual.gather(1, at)[:, 0] if width else target_probs[:, 0]
    bonus = target_probs.gather(1, kept[:, None, None].expand(-1, 1, vocab))[:, 0]
    usable = recovered.sum(dim=-1, keepdim=True) > 0
    last_probs = torch.where((kept < lengths)[:, None] & usable, recovered, bonus)
    token = torch.multinomial(last_probs, 1, generator=generator)[:, 0]
    return _outcomes(drafts, kept, token)


def _within(drafts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[R, K]: which padded draft slots hold a request's draft."""
    return torch.arange(drafts.shape[1], device=drafts.device)[None, :] < lengths[:, None]


def _leading(accepts: torch.Tensor) -> torch.Tensor:
    """[R]: how many of each row's flags hold before its first False."""
    return accepts.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _outcomes(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> list[Verified]:
    """One host read of the step's drafts, counts and last tokens."""
    drafts_host, accepted_host, last_host = drafts.tolist(), accepted.tolist(), last.tolist()
    return [Verified(tuple(row[:count]) + (token,), count)
            for row, count, token in zip(drafts_host, accepted_host, last_host, strict=True)]
