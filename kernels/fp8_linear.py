"""y = x @ W^T with W as released: float8_e4m3fn values and one float32 scale per block x block tile
(`model.quantization: checkpoint`; kernels/quant.py has the format).

Decode reads every weight once a step, so keeping W in fp8 halves the bytes a bf16 copy would take.
- `fp8_linear_reference`: dequantize W, then F.linear in x's dtype (the CPU path; allocates W in full).
- `fp8_linear_triton`: one program per (rows of x, block of output columns, share of K) tile; it
  streams its W tile in `block`-wide steps of K, scales each row of the tile by its block's scale as it
  converts it to x's dtype, and accumulates tl.dot in float32. W is never materialised in bf16. A decode
  step has one tile of rows, so K is split until ~2 programs run per SM (a 4096-wide projection would
  otherwise be 64 programs); the shares' float32 partial sums are added in a fixed order, not by atomics,
  so a result does not depend on timing (graph replays equal eager runs bitwise).
Both round each product of W's values and scales to x's dtype first, so they differ only in the order
of the float32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import FP8_BLOCK, dequantize_fp8_blocks

try:
    import triton
    import triton.language as tl

    from kernels.quant import _e4m3_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK_M, BLOCK_N = 16, 32  # rows of x (tl.dot's smallest) and output columns per program
TARGET_PROGRAMS = 264  # two per SM of an H200
TRITON_MAX_ROWS = 256  # decode-sized inputs; larger ones dequantize W once and take cuBLAS


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / float32), weight [N, K] fp8, scale [ceil(N / block), ceil(K / block)]
    float32 -> [..., N] in x's dtype: the Triton kernel on the GPU, the reference elsewhere (and for
    prefill-sized x, where cuBLAS on the dequantized matrix wins)."""
    if triton is None or not x.is_cuda or x.numel() // x.shape[-1] > TRITON_MAX_ROWS:
        return fp8_linear_reference(x, weight, scale, block)
    return fp8_linear_triton(x, weight, scale, block)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    return F.linear(x, dequantize_fp8_blocks(weight, scale, block).to(x.dtype))


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    k_steps = triton.cdiv(k, block)
    split = max(1, min(k_steps, TARGET_PROGRAMS // max(tiles, 1)))
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), split)
        _fp8_linear_kernel[grid](rows, weight.view(torch.uint8), scale.float().contiguous(), partial, m, n, k,
                                 scale.shape[1], steps_per_split, BLOCK=block, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return partial.sum(dim=0).to(x.dtype).view(*x.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _fp8_linear_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, m, n, k, k_blocks, steps_per_split, BLOCK: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Program (i, j, s): rows tile i, columns tile j, K blocks [s * steps_per_split, ...) ->
        float32 partial sums out[s, rows, cols]."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        share = tl.program_id(2)
        in_rows, in_cols = rows < m, cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = share * steps_per_split * BLOCK
        for start in range(first, tl.minimum(first + steps_per_split * BLOCK, k), BLOCK):
            inner = start + tl.arange(0, BLOCK)
            in_inner = inner < k
            xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * k + inner[None, :],
                         mask=in_rows[:, None] & in_inner[None, :], other=0.0)
            raw = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + inner[None, :],
                          mask=in_cols[:, None] & in_inner[None, :], other=0)
            w = _e4m3_to_float(raw.to(tl.int32))
            s = tl.load(scale_ptr + (cols // BLOCK) * k_blocks + start // BLOCK, mask=in_cols, other=0.0)
            w = (w * s[:, None]).to(xs.dtype)
            acc += tl.dot(xs, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
        out = out_ptr + share.to(tl.int64) * m * n
        tl.store(out + rows[:, None].to(tl.int64) * n + cols[None, :], acc, mask=in_rows[:, None] & in_cols[None, :])
