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

Weights are bf16 / float matrices [E, rows, cols], or MXFP4 as released (`MXFP4Experts`: E2M1 codes
two a byte and an E8M0 exponent per 32 inputs, `model.quantization: checkpoint`, kept in
kernels/quant.py). With bf16 activations on the GPU they run on the tensor cores, each chosen expert
read once for all its tokens (kernels/moe_mxfp4.py); the pairwise kernels decode them as they stream
them for other dtypes, and the reference dequantizes expert by expert. A bf16 model on an sm_90+ GPU
holds them laid out for the CUDA decode kernel instead (`MXFP4MMAExperts`, kernels/moe_mxfp4_mma.py:
decode steps there, prefill chunks through kernels/moe_mxfp4.py's sorted kernels, which read that
layout too).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.batch_invariant import batch_invariant_active
from kernels.moe_mxfp4 import MAX_SCAN_PAIRS, experts_by_expert, experts_sorted
from kernels.mma_layout import MXFP4MMAExperts
from kernels.moe_mxfp4_fp8 import experts_sorted_fp8, widths_fit
from kernels.moe_mxfp4_mma import experts_mma
from kernels.moe_pairs import pair_table, plus_residual, sum_pairs, swiglu_pairs
from kernels.norm import rows_in_place
from kernels.quant import MXFP4Experts

try:
    import triton
    import triton.language as tl

    from kernels.quant import _e8m0_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

# (token, expert) pairs up to which `experts_pairwise` runs instead of the grouped GEMM. Measured on
# the H200 (bench/kernels.py, V4-Flash experts, top-6): pairwise was faster at every decode size tried,
# 1 to 32 tokens (0.38 vs 0.87 ms at 6 pairs, 2.35 vs 2.81 ms at 192); prefill chunks take the GEMM.
PAIRWISE_MAX_PAIRS = 256
# (output rows, input columns) per program step, from bench.kernels' sweep on the H200: within 5% of
# the best shape at 1 token and the best at 32 (gate/up 0.214 / 2.099 ms, down 0.215 / 2.192 ms)
GATE_UP_BLOCKS = (16, 128)
# MXFP4 experts have no grouped GEMM here: the pairwise kernels run up to this many pairs (a decode
# step of ~170 sequences at top-6), the per-expert dequantizing loop beyond (prefill chunks)
MXFP4_PAIRWISE_MAX_PAIRS = 1024
DOWN_BLOCKS = (32, 64)
# elements per program of the SwiGLU kernel
SWIGLU_BLOCK = 1024


ExpertWeights = torch.Tensor | MXFP4Experts | MXFP4MMAExperts


def _matrix(weights: ExpertWeights, local: int, dtype: torch.dtype) -> torch.Tensor:
    return weights[local] if isinstance(weights, torch.Tensor) else weights.expert(local, dtype)


def clamped_swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate clamped from above) x up clamped both sides, rounded as torch rounds it (silu's output
    to the inputs' dtype, then the product): one launch on CUDA for the ~4 of torch's (the shared
    expert's, every layer of a decode step); torch's ops in deterministic mode."""
    if triton is None or not gate.is_cuda or batch_invariant_active() or gate.shape != up.shape:
        return clamped_swiglu_reference(gate, up, limit)
    return clamped_swiglu_triton(gate, up, limit)


def clamped_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate and up may be row-strided (column slices of one wider output, as fp8_linear_pair's): read
    in place; out is contiguous."""
    shape, width = gate.shape, gate.shape[-1]
    gate, up = rows_in_place(gate), rows_in_place(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    count = gate.numel()
    _clamped_swiglu_kernel[(triton.cdiv(count, SWIGLU_BLOCK),)](gate, up, out, count, width, gate.stride(0), up.stride(0),
                                                                limit, BLOCK=SWIGLU_BLOCK)
    return out.view(shape)



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
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D], weights / experts [T, k], gate_up [E, 2I, D], down [E, D, I] (tensors or MXFP4) ->
    float32 [T, D]; with `residual` [T, D] (the shared expert's output, when nothing is summed across
    ranks in between): sum + residual in residual's dtype, as every path below. Each token's pairs are
    added in top-k slot order, as the GPU kernels add them (kernels/moe_pairs.py), so where an expert's
    weights sit (its id within a rank's run, a slot of the expert offload cache) changes no bit."""
    tokens, k = experts.shape
    pair_out = torch.zeros(tokens, k, x.shape[1], dtype=torch.float32, device=x.device)
    held = gate_up.shape[0]
    for expert in torch.unique(experts).tolist():
        local = expert - first
        if not 0 <= local < held:  # another rank's expert (or a pair left out): adds 0
            continue
        token_rows, slot = torch.where(experts == expert)
        weight = weights[token_rows, slot, None]
        gate, up = F.linear(x[token_rows], _matrix(gate_up, local, x.dtype)).chunk(2, dim=-1)
        hidden = clamped_swiglu(gate.float(), up.float(), limit)
        down_matrix = _matrix(down, local, x.dtype)
        if weight_before_down:
            y = F.linear((hidden * weight).to(x.dtype), down_matrix).float()
        else:
            y = F.linear(hidden.to(x.dtype), down_matrix).float() * weight
        pair_out[token_rows, slot] = y
    out = pair_out[:, 0]
    for slot in range(1, k):
        out = out + pair_out[:, slot]
    return plus_residual(out, residual)


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `experts_reference`, without a host sync: the pairs sorted by expert through
    two grouped GEMMs, the SwiGLU between them and the per-token sum after them as one launch each
    (kernels/moe_pairs.py), the sum reading each pair's row where the sort put it. (In torch the
    float32 casts, weighting, masking, the scatter back to slot order and the sum were ~8% of a 32K
    bf16 prefill on the H200.)"""
    tokens, k = experts.shape
    held = gate_up.shape[0]
    expert_of, weight = pair_table(experts, weights, first, held)
    group = torch.where(expert_of >= 0, expert_of, held)  # pairs of other ranks' experts sort last, past every group
    order = torch.argsort(group, stable=True)
    ends = torch.searchsorted(group[order], torch.arange(1, held + 1, device=x.device, dtype=group.dtype))
    offsets = ends.to(torch.int32)
    gate_up_rows = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offsets)
    hidden = swiglu_pairs(gate_up_rows[None], expert_of[order], weight[order], limit, weight_before_down, x.dtype)
    y = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets)  # rows past the last group stay unwritten
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=x.device)
    return sum_pairs(y[None], expert_of, weight, k, weight_before_down, residual, rows=row_of)


def experts_pairwise(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None,
    gate_up_blocks: tuple[int, int] = GATE_UP_BLOCKS, down_blocks: tuple[int, int] = DOWN_BLOCKS,
) -> torch.Tensor:
    """Same contract as `experts_reference`, as Triton kernels (no host sync); float32 accumulation
    without the reference's bf16 rounding of gate / up. MXFP4 weights are decoded in the kernels."""
    tokens, k = experts.shape
    held, double_inter, dim = gate_up.shape
    inter = double_inter // 2
    expert_of, weight = pair_table(experts, weights, first, held)
    x = x.contiguous()
    hidden = torch.empty(tokens * k, inter, dtype=x.dtype, device=x.device)
    rows, columns = gate_up_blocks
    packed = isinstance(gate_up, MXFP4Experts)
    values, scales = _kernel_operands(gate_up)
    _gate_up_kernel[(tokens * k, triton.cdiv(inter, rows))](
        x, expert_of, weight, values, scales, hidden, k, dim, inter, limit, weight_before_down,
        MXFP4=packed, BLOCK_N=rows, BLOCK_K=columns, num_warps=4,
    )
    out = torch.empty(1, tokens * k, dim, dtype=torch.float32, device=x.device)
    rows, columns = down_blocks
    values, scales = _kernel_operands(down)
    _down_kernel[(tokens * k, triton.cdiv(dim, rows))](
        hidden, expert_of, weight, values, scales, out, dim, inter, weight_before_down,
        MXFP4=packed, BLOCK_N=rows, BLOCK_K=columns, num_warps=4,
    )
    return sum_pairs(out, expert_of, weight, k, True, residual)  # the down kernel applied the weights


def _kernel_operands(weights: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(values or codes, scales) as the kernels take them; plain weights pass themselves as the unused
    scales argument."""
    if isinstance(weights, MXFP4Experts):
        return weights.codes, weights.scales
    return weights, weights


def experts_on_device(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None,
    fp8_prefill: bool = False,
) -> torch.Tensor:
    """The GPU path: pairwise kernels for a few pairs (a decode step of a small batch), grouped GEMMs
    otherwise. `fp8_prefill` (`model.prefill_activations: fp8`): MXFP4 experts of bf16 x beyond
    MAX_SCAN_PAIRS pairs take kernels/moe_mxfp4_fp8.py's sorted kernels (FP8 activations) where dim and
    inter are multiples of its STEP. MXFP4 experts with bf16 activations: the tensor-core kernels of
    kernels/moe_mxfp4.py (scanning up to its MAX_SCAN_PAIRS, sorted beyond); other activation dtypes: pairwise up to
    MXFP4_PAIRWISE_MAX_PAIRS pairs and whenever a graph is being captured (the loop syncs), else the
    reference loop, which dequantizes each chosen expert. MXFP4 experts laid out for
    kernels/moe_mxfp4_mma.py (bf16 models only): its CUDA kernel up to MAX_SCAN_PAIRS pairs, the
    sorted Triton kernels beyond."""
    if fp8_prefill and _fp8_prefill_applies(x, experts, gate_up):
        run = experts_sorted_fp8
    elif isinstance(gate_up, MXFP4MMAExperts):  # laid out only for bf16 models (models/moe.py)
        run = experts_mma if experts.numel() <= MAX_SCAN_PAIRS else experts_sorted
    elif isinstance(gate_up, MXFP4Experts):
        if x.dtype == torch.bfloat16 and triton is not None:
            run = experts_by_expert if experts.numel() <= MAX_SCAN_PAIRS else experts_sorted
        else:
            pairwise = experts.numel() <= MXFP4_PAIRWISE_MAX_PAIRS or torch.cuda.is_current_stream_capturing()
            run = experts_pairwise if pairwise else experts_reference
    else:
        small = triton is not None and experts.numel() <= PAIRWISE_MAX_PAIRS
        run = experts_pairwise if small else experts_grouped
    return run(x, weights, experts, gate_up, down, first, limit, weight_before_down, residual)


def _fp8_prefill_applies(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor | MXFP4Experts | MXFP4MMAExperts
                         ) -> bool:
    return (isinstance(gate_up, (MXFP4Experts, MXFP4MMAExperts)) and triton is not None
            and x.dtype == torch.bfloat16 and experts.numel() > MAX_SCAN_PAIRS and widths_fit(gate_up))


if triton is not None:

    @triton.jit(do_not_specialize=["count"])
    def _clamped_swiglu_kernel(gate_ptr, up_ptr, out_ptr, count, width, gate_stride, up_stride, limit,
                               BLOCK: tl.constexpr):
        limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
        index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < count
        row, column = index // width, index % width
        gate = tl.minimum(tl.load(gate_ptr + row * gate_stride + column, mask=inside, other=0.0).to(tl.float32), limit)
        up = tl.load(up_ptr + row * up_stride + column, mask=inside, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = silu * tl.minimum(tl.maximum(up, -limit), limit)
        tl.store(out_ptr + index, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _weight_tile(values_ptr, rows, cols, n_cols, mask):
        """Plain weights [len(rows), len(cols)] as float32 of a row-major matrix with `n_cols` columns
        (`rows` counted from the stacked experts' first row)."""
        return tl.load(values_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _e2m1(code):
        """E2M1 codes (sign, 2 exponent bits, 1 mantissa bit) -> float32, from the bits: exponent 0 is
        0 or 0.5, else (1 + m / 2) x 2 ** (e - 1)."""
        exponent, mantissa = (code >> 1) & 3, code & 1
        bits = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
        return (bits | ((code >> 3) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _mxfp4_rows_dot(codes_ptr, scales_ptr, rows, half, n_cols, mask, x_even, x_odd):
        """sum over a K step of W[rows, k] x[k] for MXFP4 rows with `n_cols` columns: byte `half[j]`
        holds columns 2j (low nibble, times x_even[j]) and 2j + 1 (high, times x_odd[j]), both under the
        E8M0 scale of their 32 columns, built from its bits (exponent 0: the subnormal 2 ** -127)."""
        byte = tl.load(codes_ptr + rows[:, None] * (n_cols // 2) + half[None, :], mask=mask, other=0).to(tl.int32)
        exponent = tl.load(scales_ptr + rows[:, None] * (n_cols // 32) + (half // 16)[None, :], mask=mask,
                           other=127).to(tl.int32)
        scale = _e8m0_to_float(exponent)
        products = _e2m1(byte & 15) * x_even[None, :] + _e2m1(byte >> 4) * x_odd[None, :]
        return tl.sum(products * scale, axis=1)

    @triton.jit
    def _gate_up_kernel(
        x_ptr, expert_ptr, weight_ptr, gate_up_ptr, scales_ptr, hidden_ptr, k, dim, inter, limit,
        WEIGHT_BEFORE_DOWN: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < inter
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        token = pair // k
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        if expert >= 0:
            first = expert * 2 * inter  # the expert's first row among all experts' rows
            for start in range(0, dim, BLOCK_K):
                if MXFP4:
                    half = start // 2 + tl.arange(0, BLOCK_K // 2)
                    in_half = half < dim // 2
                    both = in_rows[:, None] & in_half[None, :]
                    x_even = tl.load(x_ptr + token * dim + 2 * half, mask=in_half, other=0.0).to(tl.float32)
                    x_odd = tl.load(x_ptr + token * dim + 2 * half + 1, mask=in_half, other=0.0).to(tl.float32)
                    gate += _mxfp4_rows_dot(gate_up_ptr, scales_ptr, first + rows, half, dim, both, x_even, x_odd)
                    up += _mxfp4_rows_dot(gate_up_ptr, scales_ptr, first + inter + rows, half, dim, both, x_even, x_odd)
                else:
                    cols = start + tl.arange(0, BLOCK_K)
                    in_cols = cols < dim
                    value = tl.load(x_ptr + token * dim + cols, mask=in_cols, other=0.0).to(tl.float32)
                    both = in_rows[:, None] & in_cols[None, :]
                    g = _weight_tile(gate_up_ptr, first + rows, cols, dim, both)
                    u = _weight_tile(gate_up_ptr, first + inter + rows, cols, dim, both)
                    gate += tl.sum(g * value[None, :], axis=1)
                    up += tl.sum(u * value[None, :], axis=1)
        gate = tl.minimum(gate, limit)
        hidden = gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(up, -limit), limit)
        if WEIGHT_BEFORE_DOWN:
            hidden = hidden * tl.load(weight_ptr + pair)
        tl.store(hidden_ptr + pair * inter + rows, hidden.to(hidden_ptr.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _down_kernel(
        hidden_ptr, expert_ptr, weight_ptr, down_ptr, scales_ptr, out_ptr, dim, inter,
        WEIGHT_BEFORE_DOWN: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pair = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < dim
        expert = tl.load(expert_ptr + pair).to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if expert >= 0:
            first = expert * dim
            for start in range(0, inter, BLOCK_K):
                if MXFP4:
                    half = start // 2 + tl.arange(0, BLOCK_K // 2)
                    in_half = half < inter // 2
                    h_even = tl.load(hidden_ptr + pair * inter + 2 * half, mask=in_half, other=0.0).to(tl.float32)
                    h_odd = tl.load(hidden_ptr + pair * inter + 2 * half + 1, mask=in_half, other=0.0).to(tl.float32)
                    acc += _mxfp4_rows_dot(down_ptr, scales_ptr, first + rows, half, inter,
                                           in_rows[:, None] & in_half[None, :], h_even, h_odd)
                else:
                    cols = start + tl.arange(0, BLOCK_K)
                    in_cols = cols < inter
                    value = tl.load(hidden_ptr + pair * inter + cols, mask=in_cols, other=0.0).to(tl.float32)
                    w = _weight_tile(down_ptr, first + rows, cols, inter, in_rows[:, None] & in_cols[None, :])
                    acc += tl.sum(w * value[None, :], axis=1)
        if not WEIGHT_BEFORE_DOWN:
            acc = acc * tl.load(weight_ptr + pair)
        tl.store(out_ptr + pair * dim + rows, acc, mask=in_rows)
