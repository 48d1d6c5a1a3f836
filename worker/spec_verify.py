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
