"""Token sampling and logprobs from one step's logits.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as vLLM and
OpenAI report them: logit_bias, the min_tokens ban and the presence / frequency / repetition
penalties change only what is drawn (greedy's argmax included), as temperature / top-k / top-p /
min-p do. Greedy takes the argmax (lowest id among equal maxima). A seeded request draws from its own
generator, keyed by seed and output index, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contract import SamplingParams, TokenLogprob
from kernels import stable_topk


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int | None) -> TokenLogprob:
    """logprobs: [vocab] log-softmax row."""
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        values, ids = stable_topk(logprobs, top_n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)


def _adjusted(
    logits: torch.Tensor, params: SamplingParams, draw_index: int,
    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
) -> torch.Tensor:
    """The logits the draw uses, in vLLM's order: logit_bias, the min_tokens ban, then penalties.

    Frequency / presence count only generated tokens; the repetition penalty covers prompt + output.
    Returns `logits` itself when nothing applies (plain requests pay nothing)."""
    banning = draw_index < params.min_tokens and bool(params.stop_token_ids)
    if not (params.logit_bias or banning or params.penalizes_output):
        return logits
    logits = logits.clone()
    device = logits.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        logits.index_add_(0, torch.tensor(ids, device=device), torch.tensor(biases, dtype=logits.dtype, device=device))
    if banning:
        logits[torch.tensor(params.stop_token_ids, device=device)] = float("-inf")
    if params.penalizes_prompt:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor([*prompt_token_ids, *output_token_ids], dtype=torch.long, device=device)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if output_token_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_token_ids, device=device), minlength=logits.shape[-1])
        counts = counts.to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def draws_plain_argmax(params: SamplingParams, draw_index: int) -> bool:
    """Greedy with nothing that reshapes the draw and no top logprobs: such rows of a step are drawn
    together by `argmax_rows` (one device sync for the batch instead of two per row)."""
    banning = draw_index < params.min_tokens and bool(params.stop_token_ids)
    return params.greedy and not (params.logit_bias or banning or params.penalizes_output or params.logprobs)


def argmax_rows(logits: torch.Tensor) -> list[TokenLogprob]:
    """logits [n, vocab] float32 -> each row's argmax (lowest id among equal maxima) with its logprob;
    the same tokens and logprobs as `sample` gives each row of a plain greedy request."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens.tolist(), chosen.tolist())]


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


def sample(
    logits: torch.Tensor, params: SamplingParams, draw_index: int,
    prompt_token_ids: Sequence[int] = (), output_token_ids: Sequence[int] = (),
) -> TokenLogprob:
    """logits: [vocab] float32 row for one sequence; draw_index: output tokens so far. The token
    histories are needed only when `params` has penalties (the scheduler fills them only then); the
    returned logprobs are the raw logits' log-softmax whatever shaped the draw."""
    logprobs = torch.log_softmax(logits, dim=-1)
    adjusted = _adjusted(logits, params, draw_index, prompt_token_ids, output_token_ids)
    if params.greedy:
        token = int(torch.argmax(adjusted))
    else:
        generator = torch.Generator(device=logits.device)
        if params.seed is not None:
            generator.manual_seed((params.seed * 1_000_003 + draw_index) % (1 << 63))  # any seed fits the generator
        else:
            generator.seed()
        probs = _filtered(adjusted, params).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token_logprobs(logprobs, token, params.logprobs)
