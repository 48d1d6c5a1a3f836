"""Token sampling and logprobs from one step's logits.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as vLLM and
OpenAI report them; temperature / top-k / top-p / min-p shape only the draw. Greedy takes the
argmax (lowest id among equal maxima). A seeded request draws from its own generator, keyed by seed
and output index, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from kernels import stable_topk
from scheduler.request import SamplingParams, TokenLogprob


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int | None) -> TokenLogprob:
    """logprobs: [vocab] log-softmax row."""
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        values, ids = stable_topk(logprobs, top_n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = stable_topk(logits, params.top_k)[0][-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(logits.softmax(-1), descending=True, stable=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, draw_index: int) -> TokenLogprob:
    """logits: [vocab] float32 row for one sequence."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        generator = torch.Generator(device=logits.device)
        if params.seed is not None:
            generator.manual_seed(params.seed * 1_000_003 + draw_index)
        else:
            generator.seed()
        probs = _filtered(logits, params).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token_logprobs(logprobs, token, params.logprobs)
