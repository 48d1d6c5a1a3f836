"""Greedy draws: each row's argmax (the lowest id among equal maxima) and its log-softmax value.

A plain greedy step needs only these two numbers a row, but torch computes the whole [rows, vocab]
log-softmax and then an argmax: two single-block passes over a 129K vocabulary, ~58 us a step on the
H200 at batch 1 (`bench.slice profile`). `argmax_logprob` is one split pass (per block of the
vocabulary: its max, first index of it, and sum of exp(x - max)) and one combine per row on CUDA;
`argmax_logprob_reference` is the torch definition (the CPU path and the test oracle). A row holding
NaN or +inf, or only -inf, gets a NaN logprob in both (the sampler then fails that row alone).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

SPLIT = 2048  # vocabulary entries per program


def argmax_logprob_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] float32 -> (token ids [rows] int64, their log-softmax [rows] float32)."""
    tokens = torch.argmax(logits, dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`argmax_logprob_reference`, as two Triton kernels on CUDA."""
    if triton is None or not logits.is_cuda or logits.shape[0] == 0:
        return argmax_logprob_reference(logits)
    return argmax_logprob_triton(logits)


def argmax_logprob_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    logits = logits.contiguous()
    splits = triton.cdiv(vocab, SPLIT)
    partial = torch.empty(rows, splits, 3, dtype=torch.float32, device=logits.device)
    _argmax_split_kernel[(rows, splits)](logits, partial, vocab, splits, BLOCK=SPLIT, num_warps=8)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _argmax_combine_kernel[(rows,)](partial, tokens, logprobs, splits, BLOCK=triton.next_power_of_2(splits))
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _argmax_split_kernel(logits_ptr, partial_ptr, vocab, splits, BLOCK: tl.constexpr):
        """partial[r, s] = (max, first index of it, sum exp(x - max)) over block s of row r; a NaN
        anywhere makes the sum NaN."""
        row, split = tl.program_id(0), tl.program_id(1)
        i = split * BLOCK + tl.arange(0, BLOCK)
        inside = i < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * vocab + i, mask=inside, other=float("-inf"))
        best = tl.max(x, axis=0)
        index = tl.min(tl.where(x == best, i, vocab), axis=0)
        total = tl.sum(tl.where(inside, tl.exp(x - best), 0.0), axis=0)
        total = tl.where(best == float("-inf"), 0.0, total)  # a block of -inf adds nothing (not NaN)
        nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
        out = partial_ptr + (row * splits + split) * 3
        tl.store(out, best)
        tl.store(out + 1, index.to(tl.float32))  # < 2^24: exact in float32
        tl.store(out + 2, tl.where(nan, float("nan"), total))

    @triton.jit
    def _argmax_combine_kernel(partial_ptr, tokens_ptr, logprobs_ptr, splits, BLOCK: tl.constexpr):
        """The row's max over the blocks (the earliest block on ties, so the lowest index), and its
        log-softmax -log(sum_s total_s * exp(max_s - max))."""
        row = tl.program_id(0)
        s = tl.arange(0, BLOCK)
        inside = s < splits
        base = partial_ptr + (row * splits + s) * 3
        best = tl.load(base, mask=inside, other=float("-inf"))
        index = tl.load(base + 1, mask=inside, other=0.0)
        total = tl.load(base + 2, mask=inside, other=0.0)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, s, BLOCK), axis=0)
        token = tl.sum(tl.where(s == first, index, 0.0), axis=0)
        scaled = tl.sum(tl.where(inside & (best > float("-inf")), total * tl.exp(best - top), 0.0), axis=0)
        empty = top == float("-inf")  # only -inf: not drawable
        logprob = tl.where(empty, float("nan"), -tl.log(tl.where(empty, 1.0, scaled)))
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, logprob)
