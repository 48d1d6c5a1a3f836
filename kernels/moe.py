"""Routed experts of a MoE layer: the weighted sum of each token's chosen experts' SwiGLU MLPs.

Two paths compute the same sum:
- `experts_reference`: a loop over the experts the batch chose (the plain torch reference). It asks
  the host which experts were chosen, so it syncs and cannot be captured in a CUDA graph.
- `experts_pairwise` (few pairs, decode): two Triton kernels, one program per (pair, block of
  output rows), each streaming its expert's rows once: gate and up rows with the SwiGLU fused, then
  the down rows. Every pair reads its own expert, so it only pays while pairs rarely share experts.
- `experts_grouped`: the (token, expert) pairs sorted by expert and run as two grouped GEMMs
  (`torch._grouped_mm`: CUTLASS on sm90+ GPUs, a loop on CPU), with the group offsets computed on the
  device. Shapes depend only on the batch size, so it never syncs and a decode step using it can be
  captured. Each token's k products are summed in slot order (not by atomics), so it is deterministic.
Experts outside this rank's run [first, first + held) contribute zero (tensor parallel: another rank
holds them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

# (token, expert) pairs up to which `experts_pairwise` runs instead of the grouped GEMM. Measured on
# the H200 (bench/kernels.py, V4-Flash experts, top-6): pairwise was faster at every decode size tried,
# 1 to 32 tokens (0.38 vs 0.87 ms at 6 pairs, 2.35 vs 2.81 ms at 192); prefill chunks take the GEMM.
PAIRWISE_MAX_PAIRS = 256
# (output rows, input columns) per program step, from bench.kernels' sweep on the H200: within 5% of
# the best shape at 1 token and the best at 32 (gate/up 0.214 / 2.099 ms, down 0.215 / 2.192 ms)
GATE_UP_BLOCKS = (16, 128)
DOWN_BLOCKS = (32, 64)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """CUDA's grouped GEMM takes bf16 only (and sm90+); the CPU fallback takes any float dtype."""
    if x.device.type == "cpu":
        return True
    return x.dtype == torch.bfloat16 and _capability(x.device.index or 0) >= 9


@functools.cache
def _capability(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


def experts_reference(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
) -> torch.Tensor:
    """x [T, D], weights / experts [T, k], gate_up [E, 2I, D], down [E, D, I] -> float32 [T, D]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    held = gate_up.shape[0]
    for expert in torch.unique(experts).tolist():
        local = expert - first
        if not 0 <= local < held:  # another rank's expert
            continue
        token_rows, slot = torch.where(experts == expert)
        weight = weights[token_rows, slot, None]
        gate, up = F.linear(x[token_rows], gate_up[local]).chunk(2, dim=-1)
        hidden = clamped_swiglu(gate.float(), up.float(), limit)
        if weight_before_down:
            y = F.linear((hidden * weight).to(x.dtype), down[local]).float()
        else:
            y = F.linear(hidden.to(x.dtype), down[local]).float() * weight
        out.index_add_(0, token_rows, y)
    return out


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
) -> torch.Tensor:
    """Same contract as `experts_reference`, without a host sync."""
    tokens, k = experts.shape
    held = gate_up.shape[0]
    local = experts.flatten() - first
    inside = (local >= 0) & (local < held)
    group = torch.where(inside, local, held)  # pairs of other ranks' experts sort last, past every group
    order = torch.argsort(group, stable=True)
    ends = torch.searchsorted(group[order], torch.arange(1, held + 1, device=x.device, dtype=group.dtype))
    offsets = ends.to(torch.int32)
    token_of = order // k
    gate, up = torch._grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    hidden = clamped_swiglu(gate.float(), up.float(), limit)
    weight = torch.where(inside[order], weights.flatten()[order], 0.0)[:, None]
    if weight_before_down:
        y = torch._grouped_mm((hidden * weight).to(x.dtype), down.transpose(1, 2), offs=offsets).float()
    else:
        y = torch._grouped_mm(hidden.to(x.dtype), down.transpose(1, 2), offs=offsets).float() * weight
    y = torch.where(inside[order][:, None], y, 0.0)  # rows past the last group are left unwritten
    per_slot = torch.empty_like(y)
    per_slot[order] = y
    return per_slot.view(tokens, k, -1).sum(dim=1)


def experts_pairwise(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
    gate_up_blocks: tuple[int, int] = GATE_UP_BLOCKS, down_blocks: tuple[int, int] = DOWN_BLOCKS,
) -> torch.Tensor:
    """Same contract as `experts_reference`, as Triton kernels (no host sync); float32 accumulation
    without the reference's bf16 rounding of gate / up."""
    tokens, k = experts.shape
    held, double_inter, dim = gate_up.shape
    inter = double_inter // 2
    local = experts.flatten() - first
    inside = (local >= 0) & (local < held)
    expert_of = torch.where(inside, local, -1).to(torch.int32).contiguous()
    weight = torch.where(inside, weights.flatten().float(), 0.0).contiguous()
    x = x.contiguous()
    hidden = torch.empty(tokens * k, inter, dtype=x.dtype, device=x.device)
    rows, columns = gate_up_blocks
    _gate_up_kernel[(tokens * k, triton.cdiv(inter, rows))](
        x, expert_of, weight, gate_up, hidden, k, dim, inter, limit, weight_before_down,
        BLOCK_N=rows, BLOCK_K=columns, num_warps=4,
    )
    out = torch.empty(tokens * k, dim, dtype=torch.float32, device=x.device)
    rows, columns = down_blocks
    _down_kernel[(tokens * k, triton.cdiv(dim, rows))](
        hidden, expert_of, weight, down, out, dim, inter, weight_before_down,
        BLOCK_N=rows, BLOCK_K=columns, num_warps=4,
    )
    return out.view(tokens, k, dim).sum(dim=1)


def experts_on_device(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
) -> torch.Tensor:
    """The GPU path: pairwise kernels for a few pairs (a decode step of a small batch), grouped GEMMs
    otherwise."""
    small = triton is not None and experts.numel() <= PAIRWISE_MAX_PAIRS
    run = experts_pairwise if small else experts_grouped
    return run(x, weights, experts, gate_up, down, first, limit, weight_before_down)


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        x_ptr, expert_ptr, weight_ptr, gate_up_ptr, hidden_ptr, k, dim, inter, limit, WEIGHT_BEFORE_DOWN: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < inter
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        token = pair // k
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        if expert >= 0:
            matrix = gate_up_ptr + expert * 2 * inter * dim
            for start in range(0, dim, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                in_cols = cols < dim
                value = tl.load(x_ptr + token * dim + cols, mask=in_cols, other=0.0).to(tl.float32)
                both = in_rows[:, None] & in_cols[None, :]
                g = tl.load(matrix + rows[:, None] * dim + cols[None, :], mask=both, other=0.0)
                u = tl.load(matrix + (inter + rows)[:, None] * dim + cols[None, :], mask=both, other=0.0)
                gate += tl.sum(g.to(tl.float32) * value[None, :], axis=1)
                up += tl.sum(u.to(tl.float32) * value[None, :], axis=1)
        gate = tl.minimum(gate, limit)
        hidden = gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(up, -limit), limit)
        if WEIGHT_BEFORE_DOWN:
            hidden = hidden * tl.load(weight_ptr + pair)
        tl.store(hidden_ptr + pair * inter + rows, hidden.to(hidden_ptr.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _down_kernel(
        hidden_ptr, expert_ptr, weight_ptr, down_ptr, out_ptr, dim, inter, WEIGHT_BEFORE_DOWN: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < dim
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if expert >= 0:
            matrix = down_ptr + expert * dim * inter
            for start in range(0, inter, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                in_cols = cols < inter
                value = tl.load(hidden_ptr + pair * inter + cols, mask=in_cols, other=0.0).to(tl.float32)
                w = tl.load(matrix + rows[:, None] * inter + cols[None, :], mask=in_rows[:, None] & in_cols[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * value[None, :], axis=1)
        if not WEIGHT_BEFORE_DOWN:
            acc = acc * tl.load(weight_ptr + pair)
        tl.store(out_ptr + pair * dim + rows, acc, mask=in_rows)
