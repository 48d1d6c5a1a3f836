"""MoE routing: a token's expert ids and weights from the router's logits.

score = score_fn(x @ W^T / temperature) in float32; the experts are a hash table's row for the token
(hash layers) or the top-k of score + correction bias (ties: the lowest index, as kernels/topk.py);
the weights are the chosen experts' plain scores, renormalised over them when asked, times the
routed scaling factor. In torch that is ~10 launches a layer (the float32 casts of x and of the
gate weight among them) plus a stable sort for the top-k: ~29 us a router at decode batch 1 on the
H200 (`bench.slice families`), for 2 MB of weights. `route` runs it as two Triton kernels on CUDA
for sqrtsoftplus scores (V4 and V4.1): the logits, one program per (token, block of experts, share of
the hidden channels), then one program per token that adds the shares' partial logits (a fixed tree,
so a token's logits do not depend on the batch), the scores, the top-k (k rounds of a max) and the
weights. The share count is fixed, not chosen by batch size, for the same reason: at batch 1 it is
what spreads the 2 MB over the SMs (32 programs of 8 experts over all 4096 channels took ~22 us).
`route_reference` is the torch definition (the CPU path and the test oracle).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.topk import stable_topk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


class LogitsConfig(NamedTuple):
    """The logits kernel's grid: experts per program, hidden channels per iteration, shares of the
    hidden channels (a power of two: the pick kernel adds them as one tile), warps."""

    expert_block: int
    k_block: int
    splits: int
    warps: int = 4


# From `python -m bench.kernels --only router` on the H200 (CUDA-graph replays, 40 weight copies cycled
# past the L2; BENCHMARKS.md, twelfth session): 16 experts x 4 shares of 1024 channels (64 programs a
# token) took 7.6 / 8.6 / 18.2 us at 1 / 8 / 32 tokens, against 6.6 / 11.7 / 25.4 for 8 x 8 shares of
# 512; the least summed over the three of 19 grids but one (32 x 8 of 256: 33.4 us against 34.4).
LOGITS_CONFIG = LogitsConfig(16, 512, 4, 4)
# From this many tokens (prefill chunks) the logits run in tiles of TILE_TOKENS tokens x TILE_EXPERTS
# experts, each tile of the weight read once for them all by one dot: the per-token programs read the
# whole 2 MB weight once per token, ~0.6 ms a router on a 2,048-token chunk on the H200. The shares of
# the hidden channels stay LOGITS_CONFIG's, so the pick kernel adds the same partial logits.
TILE_MIN_TOKENS = 64
TILE_TOKENS = 64
TILE_EXPERTS = 64
TILE_K = 64


def route_reference(
    x: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, top_k: int, temperature: float, scale: float,
    renormalize: bool, score_fn: str, bias: torch.Tensor | None = None, table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, k] float32, expert ids [T, k] int64). `table` [vocab, k]: hash routing
    by token id; otherwise the top-k of score + `bias`."""
    scores = SCORE_FUNCTIONS[score_fn](F.linear(x.float(), weight.float()) / temperature)
    if table is not None:
        experts = table[token_ids].long()
    else:
        _, experts = stable_topk(scores + bias, top_k)
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


def route(
    x: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, top_k: int, temperature: float, scale: float,
    renormalize: bool, score_fn: str, bias: torch.Tensor | None = None, table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`, as two Triton kernels on CUDA for sqrtsoftplus scores."""
    if triton is None or not x.is_cuda or score_fn != "sqrtsoftplus" or x.shape[0] == 0:
        return route_reference(x, weight, token_ids, top_k, temperature, scale, renormalize, score_fn, bias, table)
    return route_triton(x, weight, token_ids, top_k, temperature, scale, renormalize, bias, table)


def route_triton(
    x: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, top_k: int, temperature: float, scale: float,
    renormalize: bool, bias: torch.Tensor | None = None, table: torch.Tensor | None = None,
    config: LogitsConfig = LOGITS_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, dim = x.shape
    experts = weight.shape[0]
    if config.splits & (config.splits - 1):
        raise ValueError(f"{config.splits} shares of the hidden channels: a power of two")
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(tokens, config.splits, experts, dtype=torch.float32, device=x.device)
    if tokens >= TILE_MIN_TOKENS:
        per_share = triton.cdiv(triton.cdiv(dim, TILE_K), config.splits) * TILE_K
        _router_logits_tiles_kernel[(triton.cdiv(tokens, TILE_TOKENS), triton.cdiv(experts, TILE_EXPERTS), config.splits)](
            x, weight, logits, tokens, experts, dim, per_share // TILE_K, BLOCK_T=TILE_TOKENS, BLOCK_E=TILE_EXPERTS,
            BLOCK_K=TILE_K, HALF_DOT=x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16),
            num_warps=4,
        )
    else:
        per_share = triton.cdiv(triton.cdiv(dim, config.k_block), config.splits) * config.k_block
        _router_logits_kernel[(tokens, triton.cdiv(experts, config.expert_block), config.splits)](
            x, weight, logits, experts, dim, per_share // config.k_block, BLOCK_E=config.expert_block,
            BLOCK_K=config.k_block, num_warps=config.warps,
        )
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    hashed = table is not None
    _router_pick_kernel[(tokens,)](
        logits, bias.float().contiguous() if bias is not None else logits,
        table.contiguous() if hashed else ids, token_ids.contiguous() if hashed else ids, weights, ids,
        experts, 1.0 / temperature, scale, K=top_k, KP=triton.next_power_of_2(top_k),
        BLOCK=triton.next_power_of_2(experts), SPLITS=config.splits, HASHED=hashed,
        RENORMALIZE=renormalize, num_warps=4,
    )
    return weights, ids


if triton is not None:

    @triton.jit(do_not_specialize=["share_steps"])
    def _router_logits_kernel(x_ptr, weight_ptr, logits_ptr, experts, dim, share_steps, BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """logits[t, s, e] = sum over share s's channels d of x[t, d] * W[e, d] in float32, for one
        block of experts (a share past the last channel stores zeros)."""
        token, block, share = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        e = block * BLOCK_E + tl.arange(0, BLOCK_E)
        rows = e < experts
        acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
        begin = share * share_steps * BLOCK_K
        for start in range(begin, tl.minimum(begin + share_steps * BLOCK_K, dim), BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            inside = k < dim
            xk = tl.load(x_ptr + token.to(tl.int64) * dim + k, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + e[:, None].to(tl.int64) * dim + k[None, :], mask=rows[:, None] & inside[None, :],
                        other=0.0).to(tl.float32)
            acc += w * xk[None, :]
        tl.store(logits_ptr + (token * tl.num_programs(2) + share) * experts + e, tl.sum(acc, axis=1), mask=rows)

    @triton.jit(do_not_specialize=["share_steps"])
    def _router_logits_tiles_kernel(x_ptr, weight_ptr, logits_ptr, tokens, experts, dim, share_steps,
                                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                    HALF_DOT: tl.constexpr):
        """`_router_logits_kernel`'s partial logits for BLOCK_T tokens x BLOCK_E experts at once, as one
        dot a step: in half precision where x and the weight both are (their products are exact in the
        float32 accumulator), else in float32 (IEEE, not TF32)."""
        block, e_block, share = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        e = e_block * BLOCK_E + tl.arange(0, BLOCK_E)
        live, rows = t < tokens, e < experts
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        begin = share * share_steps * BLOCK_K
        for start in range(begin, tl.minimum(begin + share_steps * BLOCK_K, dim), BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            inside = k < dim
            xk = tl.load(x_ptr + t[:, None].to(tl.int64) * dim + k[None, :], mask=live[:, None] & inside[None, :],
                         other=0.0)
            w = tl.load(weight_ptr + e[None, :].to(tl.int64) * dim + k[:, None], mask=rows[None, :] & inside[:, None],
                        other=0.0)
            if HALF_DOT:
                acc = tl.dot(xk, w, acc)
            else:
                acc = tl.dot(xk.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        out = logits_ptr + (t[:, None] * tl.num_programs(2) + share) * experts + e[None, :]
        tl.store(out, acc, mask=live[:, None] & rows[None, :])

    @triton.jit
    def _router_pick_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, weights_ptr, ids_ptr, experts,
                            inv_temperature, scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                            SPLITS: tl.constexpr, HASHED: tl.constexpr, RENORMALIZE: tl.constexpr):
        """One token: its SPLITS partial logits added, sqrtsoftplus scores (softplus as torch: x past 20
        is itself, else log1p(e^x), whose small e^x a plain log(1 + e^x) would round away), the experts
        (its hash row, or k rounds of the largest score + bias, the lowest index on ties), their
        renormalised, scaled weights."""
        token = tl.program_id(0)
        e = tl.arange(0, BLOCK)
        inside = e < experts
        shares = tl.arange(0, SPLITS)
        partial = tl.load(logits_ptr + (token * SPLITS + shares[:, None]) * experts + e[None, :], mask=inside[None, :],
                          other=0.0)
        z = tl.sum(partial, axis=0) * inv_temperature
        y = tl.exp(tl.minimum(z, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))  # Kahan's log1p: exact to ~1 ulp for small y
        softplus = tl.where(z > 20.0, z, log1p)
        scores = tl.sqrt(softplus)
        j = tl.arange(0, KP)  # K padded to a power of two; padding picks no expert (-1)
        used = j < K
        if HASHED:
            token_id = tl.load(token_ids_ptr + token)
            chosen = tl.load(table_ptr + token_id * K + j, mask=used, other=-1).to(tl.int32)
        else:
            biased = tl.where(inside, scores + tl.load(bias_ptr + e, mask=inside, other=0.0), float("-inf"))
            chosen = tl.full([KP], -1, tl.int32)
            for r in tl.static_range(K):
                best = tl.max(biased, axis=0)
                index = tl.min(tl.where(biased == best, e, BLOCK), axis=0)
                chosen = tl.where(j == r, index, chosen)
                biased = tl.where(e == index, float("-inf"), biased)
        picked = tl.sum(tl.where(e[None, :] == chosen[:, None], scores[None, :], 0.0), axis=1)
        if RENORMALIZE:
            picked = picked / (tl.sum(picked, axis=0) + 1e-20)
        tl.store(weights_ptr + token * K + j, picked * scale, mask=used)
        tl.store(ids_ptr + token * K + j, chosen.to(tl.int64), mask=used)
