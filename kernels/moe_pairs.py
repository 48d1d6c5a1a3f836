"""The per-pair table, the activation between the two GEMMs and the per-token sum around the
routed-expert kernels (kernels/moe.py's pairwise and grouped paths, kernels/moe_mxfp4.py's tensor-core
kernels), one launch each.

A MoE layer's experts work on (token, slot) pairs. Before their GEMMs they need each pair's expert
among this rank's run (int32, -1 for another rank's) and its routing weight (float32, 0 for another
rank's); after them, each token's sum over its k slots (and over the K shares of a split GEMM), times
the weights where the down kernel has not applied them, plus the shared expert's output where the
caller adds it, in the layer's dtype. In torch that was ~8 launches before and ~5 after (index
arithmetic, compares, `where`, casts, a zero fill, the sum, the shared add and two casts), 13 small
launches a layer a decode step (docs/decode-launches.md, G4); here it is 2.

Between the GEMMs, `swiglu_pairs` turns a pair's gate / up row (summed over the K shares of a split
GEMM) into its clamped SwiGLU in bf16, times the routing weight where it comes before down.

`pair_table_reference`, `swiglu_pairs_reference` and `sum_pairs_reference` are the torch definitions
(the CPU path and the test oracle). The sum adds the slots in slot order and the shares in share order,
from 0, in float32: the same bits however many tokens the batch holds. Rows may sit in another order
than their pairs (the grouped GEMMs' rows are sorted by expert): `rows` maps each pair to its row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

# pairs per program of the table kernel; output columns per program of the sum and of the SwiGLU
TABLE_BLOCK = 1024
SUM_BLOCK = 256
SWIGLU_BLOCK = 256


def pair_table_reference(experts: torch.Tensor, weights: torch.Tensor, first: int, held: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """experts / weights [T, k] -> (expert_of int32 [T k]: the local expert or -1, weight float32
    [T k]: the routing weight or 0 for another rank's pair)."""
    local = experts.flatten() - first
    inside = (local >= 0) & (local < held)
    return torch.where(inside, local, -1).to(torch.int32), torch.where(inside, weights.flatten().float(), 0.0)


def pair_table(experts: torch.Tensor, weights: torch.Tensor, first: int, held: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_table_reference`, one launch on CUDA."""
    if triton is None or not experts.is_cuda:
        return pair_table_reference(experts, weights, first, held)
    return pair_table_triton(experts, weights, first, held)


def pair_table_triton(experts: torch.Tensor, weights: torch.Tensor, first: int, held: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = experts.numel()
    expert_of = torch.empty(pairs, dtype=torch.int32, device=experts.device)
    weight = torch.empty(pairs, dtype=torch.float32, device=experts.device)
    _pair_table_kernel[(triton.cdiv(pairs, TABLE_BLOCK),)](
        experts.contiguous(), weights.contiguous(), expert_of, weight, pairs, first, held, BLOCK=TABLE_BLOCK,
    )
    return expert_of, weight


def swiglu_pairs_reference(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, limit: float,
                           weighted: bool, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """partial [shares, rows, 2 x inter] (float32 sums, or one share of a GEMM's output: gate then up)
    -> [rows, inter] in `dtype`: the clamped SwiGLU (kernels/moe.py's) of the rows summed over the shares
    in float32, times weight [rows] where `weighted` (the weight before down), 0 where expert_of [rows]
    is -1 (another rank's row, never read)."""
    sums = partial[0].float()
    for share in range(1, partial.shape[0]):
        sums = sums + partial[share].float()
    gate, up = sums.chunk(2, dim=-1)
    hidden = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if weighted:
        hidden = hidden * weight[:, None]
    return torch.where((expert_of >= 0)[:, None], hidden, 0.0).to(dtype)


def swiglu_pairs(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, limit: float,
                 weighted: bool, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`swiglu_pairs_reference`, one launch on CUDA."""
    if triton is None or not partial.is_cuda:
        return swiglu_pairs_reference(partial, expert_of, weight, limit, weighted, dtype)
    return swiglu_pairs_triton(partial, expert_of, weight, limit, weighted, dtype=dtype)


def swiglu_pairs_triton(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, limit: float,
                        weighted: bool, out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """`out`: the [rows, inter] to write (None: a new one in `dtype`); another rank's rows are left as
    they were."""
    shares, pairs, double_inter = partial.shape
    inter = double_inter // 2
    out = torch.empty(pairs, inter, dtype=dtype, device=partial.device) if out is None else out
    if pairs:
        _swiglu_shares_kernel[(pairs, triton.cdiv(inter, SWIGLU_BLOCK))](
            partial, expert_of, weight, out, pairs, inter, shares, limit, weighted, BLOCK=SWIGLU_BLOCK, num_warps=4,
        )
    return out


def sum_pairs_reference(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, k: int, weighted: bool,
                        residual: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """partial [shares, R, dim] (float32, or bf16 GEMM output) -> per token the sum over its k slots
    (slot order) of the pair's rows summed over the shares (share order) in float32, times its weight
    unless `weighted` (applied already); another rank's pair adds 0 whatever its rows hold. `rows`
    [pairs]: the row holding each pair (None: row p holds pair p). With `residual` [T, dim]:
    (sum + residual) in residual's dtype, else the float32 sum."""
    if rows is not None:
        partial = partial[:, rows]
    shares, pairs, dim = partial.shape
    total = torch.zeros(pairs // k, dim, dtype=torch.float32, device=partial.device)
    by_slot = partial.float().view(shares, pairs // k, k, dim)
    mine = (expert_of >= 0).view(-1, k)
    scale = weight.view(-1, k)
    for slot in range(k):
        acc = torch.zeros_like(total)
        for share in range(shares):
            acc = acc + by_slot[share, :, slot]
        if not weighted:
            acc = acc * scale[:, slot, None]
        total = total + torch.where(mine[:, slot, None], acc, 0.0)
    return plus_residual(total, residual)


def plus_residual(total: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """float32 `total`, or (total + residual) in residual's dtype: the routed experts' sum with the
    shared expert's output added, the layer's output."""
    return total if residual is None else (total + residual.float()).to(residual.dtype)


def sum_pairs(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, k: int, weighted: bool,
              residual: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_pairs_reference`, one launch on CUDA."""
    if triton is None or not partial.is_cuda:
        return sum_pairs_reference(partial, expert_of, weight, k, weighted, residual, rows)
    return sum_pairs_triton(partial, expert_of, weight, k, weighted, residual, rows)


def sum_pairs_triton(partial: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, k: int, weighted: bool,
                     residual: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    shares, held_rows, dim = partial.shape
    pairs = expert_of.numel()
    tokens = pairs // k
    out = torch.empty(tokens, dim, dtype=torch.float32 if residual is None else residual.dtype, device=partial.device)
    has_residual, has_rows = residual is not None, rows is not None
    _sum_pairs_kernel[(tokens, triton.cdiv(dim, SUM_BLOCK))](
        partial, expert_of, weight, residual.contiguous() if has_residual else out, rows.contiguous() if has_rows else
        expert_of, out, held_rows, dim, shares, k, WEIGHTED=weighted, RESIDUAL=has_residual, ROWS=has_rows,
        BLOCK=SUM_BLOCK, num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _pair_table_kernel(experts_ptr, weights_ptr, expert_of_ptr, weight_ptr, pairs, first, held,
                           BLOCK: tl.constexpr):
        pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = pair < pairs
        local = tl.load(experts_ptr + pair, mask=inside, other=-1).to(tl.int64) - first
        mine = (local >= 0) & (local < held)
        tl.store(expert_of_ptr + pair, tl.where(mine, local, -1).to(tl.int32), mask=inside)
        weight = tl.load(weights_ptr + pair, mask=inside, other=0.0).to(tl.float32)
        tl.store(weight_ptr + pair, tl.where(mine, weight, 0.0), mask=inside)

    @triton.jit(do_not_specialize=["held_rows", "shares"])
    def _sum_pairs_kernel(partial_ptr, expert_of_ptr, weight_ptr, residual_ptr, rows_ptr, out_ptr, held_rows, dim,
                          shares, k, WEIGHTED: tl.constexpr, RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """`held_rows`: partial's rows a share; ROWS: pair p's row is rows[p] (else p)."""
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_cols = cols < dim
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for slot in range(0, k):
            pair = token * k + slot
            mine = tl.load(expert_of_ptr + pair) >= 0
            inside = in_cols & (cols * 0 + mine.to(tl.int32) > 0)  # a vector: the interpreter's masks
            if ROWS:
                row = tl.load(rows_ptr + pair).to(tl.int64)
            else:
                row = pair.to(tl.int64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for share in range(0, shares):
                acc += tl.load(partial_ptr + (share * held_rows + row) * dim + cols, mask=inside, other=0.0).to(tl.float32)
            if not WEIGHTED:
                acc = acc * tl.load(weight_ptr + pair)
            total += tl.where(inside, acc, 0.0)
        if RESIDUAL:
            total += tl.load(residual_ptr + token.to(tl.int64) * dim + cols, mask=in_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * dim + cols, total.to(out_ptr.dtype.element_ty), mask=in_cols)

    @triton.jit
    def _swiglu(gate, up, limit):
        """The clamped SwiGLU of kernels/moe.py's clamped_swiglu, in float32."""
        gate = tl.minimum(gate, limit)
        return gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(up, -limit), limit)

    @triton.jit(do_not_specialize=["pairs", "shares"])
    def _swiglu_shares_kernel(partial_ptr, expert_of_ptr, weight_ptr, hidden_ptr, pairs, inter, shares, limit,
                              WEIGHT_BEFORE_DOWN: tl.constexpr, BLOCK: tl.constexpr):
        """hidden[pair, cols] = SwiGLU of gate / up summed over the shares in share order (another rank's
        pair: its partial rows were never written, and nothing reads its hidden row)."""
        limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
        pair = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = (cols < inter) & (cols * 0 + tl.load(expert_of_ptr + pair) >= 0)  # a vector: the interpreter's masks
        gate = tl.zeros([BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for share in range(0, shares):
            row = partial_ptr + (share * pairs + pair).to(tl.int64) * 2 * inter
            gate += tl.load(row + cols, mask=inside, other=0.0).to(tl.float32)
            up += tl.load(row + inter + cols, mask=inside, other=0.0).to(tl.float32)
        hidden = _swiglu(gate, up, limit)
        if WEIGHT_BEFORE_DOWN:
            hidden = hidden * tl.load(weight_ptr + pair)
        tl.store(hidden_ptr + pair.to(tl.int64) * inter + cols, hidden.to(hidden_ptr.dtype.element_ty), mask=inside)
