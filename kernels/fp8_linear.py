"""y = x @ W^T with W as released: float8_e4m3fn values and one float32 scale per block x block tile
(`model.quantization: checkpoint`; kernels/quant.py has the format).

Decode reads every weight once a step, so keeping W in fp8 halves the bytes a bf16 copy would take.
- `fp8_linear_reference`: dequantize W, then F.linear in x's dtype (the CPU path; allocates W in full).
- `fp8_linear_triton`: one program per (rows of x, block of output columns, share of K) tile; it
  streams its W tile in steps of BLOCK_K columns of K, scales each row of the tile by its blocks' scales
  as it converts it to x's dtype, and accumulates tl.dot in float32. W is never materialised in bf16. A
  decode step has one tile of rows, so K is split until the grid holds `DecodeConfig.programs` programs
  (a 4096-wide projection would otherwise be 64); the shares' float32 partial sums are added in a fixed
  order by one small kernel, not by atomics, so a result does not depend on timing (graph replays equal
  eager runs bitwise), nor on the batch while the rows fit one tile. Its tile, K step, grid size, warps
  and pipelining depth are `DECODE_CONFIGS` (by block size and rows), picked by bench.kernels' fp8_decode
  sweep.
- `fp8_linear_pair`: two weights that read the same x (q_a and kv, a shared expert's gate and up)
  in one split-K launch, their outputs side by side in one tensor (returned as column slices; the
  norm and SwiGLU kernels read them in place). At a batch of 1 a small projection's time is mostly one
  launch's latency: on the H200 this took a V4-Flash step's FP8 launches from 28 to 20.
Both round each product of W's values and scales to x's dtype first, so they differ only in the order
of the float32 accumulation. (Scaling each block's dot after it instead, exact for power-of-two
scales, measured slower at every V4 shape: BENCHMARKS.md, nineteenth session.)
- `fp8_linear_dequant` (x above TRITON_MAX_ROWS rows: prefill, decode batches): one Triton pass writes
  W in x's dtype, bitwise the reference's, then cuBLAS; on the H200 this beat the split-K kernel above
  32 rows (128 blocks) / 16 (32 blocks) and the torch dequantization by 1.4-2.3x (bench/fp8_linear.py;
  BENCHMARKS.md has the table).
- `fp8_linear_scaled_mm` (opt-in, `fp8_activations`: `model.prefill_activations: fp8`): FP8 tensor cores
  through torch's blockwise scaled matmul, x quantized per 1 x 128 group; 128 x 128 blocks only (torch has no 32 x 32 recipe on sm90).
- `fp8_linear_tc` / `fp8_linear_w8a8`: Triton tensor-core tiles (W decoded in registers / fp8 x fp8,
  any block size), tested but not dispatched: measured slower than the paths above (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.quant import FP8_BLOCK, _as_float_scales, dequantize_fp8_blocks
from kernels.split_k import tile_counters

try:
    import triton
    import triton.language as tl

    from kernels.quant import _e4m3_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK_M = 16  # rows of x per program (tl.dot's smallest)


class DecodeConfig(NamedTuple):
    """The split-K kernel's shape: output columns per program, K columns per step (a multiple or a
    divisor of the scale block), the programs the K split aims at (it stops at one K step a share),
    warps, and software-pipelining depth (num_stages). (W x x^T, the weights as wgmma's register
    operand, measured 3-30% slower at every V4 shape: BENCHMARKS.md, fourteenth session.)"""

    block_n: int
    block_k: int
    programs: int
    warps: int = 4
    stages: int = 3


# Per scale block, (up to this many rows, config) rows, the first that holds x's rows applies (x above
# TRITON_MAX_ROWS never comes here). From `python -m bench.fp8_linear --configs --m 1 8 32` on the H200
# (BENCHMARKS.md, twelfth session): summed over the V4-Flash / V4.1-Flash projection shapes, 64-column
# tiles stepping 128 of K, K split to two programs an SM, were the fastest at 1 and 8 rows for both
# block sizes (47.3 us against 53.3 for the 32-column tiles with 128 blocks, 48.5 against 150.7 for
# 32 x 32 blocks stepped one block at a time); at 32 rows with 32 blocks, four programs an SM and four
# stages (77.0 us against 91.0).
DECODE_CONFIGS: dict[int, tuple[tuple[int, DecodeConfig], ...]] = {
    128: ((32, DecodeConfig(64, 128, 264, 4, 3)),),
    32: ((16, DecodeConfig(64, 128, 264, 4, 3)), (32, DecodeConfig(64, 128, 528, 4, 4))),
}
SUM_BLOCK = 1024  # output elements per program of the kernel that adds the K shares
# Rows of x up to which the split-K kernel runs, per block size; above, W is dequantized to x's dtype by
# a Triton pass and cuBLAS multiplies (bench/fp8_linear.py, H200: with 128 blocks split-K wins at 32 rows
# on all four V4-Flash shapes and loses at 256; with 32 blocks, once stepped 128 of K at a time, split-K
# takes 77 us at 32 rows over the three V4.1-Flash shapes against the dequant path's 152).
TRITON_MAX_ROWS = {128: 32, 32: 32}
# With fp8_activations (opt-in): x quantized to e4m3 per 1 x 128 group (the release's dynamic activations)
# and torch's blockwise FP8 GEMM (cuBLASLt, sm90, CUDA >= 12.9) from SCALED_MM_MIN_ROWS rows, 128 x 128
# blocks only. Not the reference's function (~2.5% relative error from e4m3's rounding of x).
SCALED_MM_MIN_ROWS = 256


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
               fp8_activations: bool = False) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / float32), weight [N, K] fp8, scale [ceil(N / block), ceil(K / block)]
    float32 -> [..., N] in x's dtype. GPU: the split-K kernel for decode-sized x (<= TRITON_MAX_ROWS[block]
    rows), else W dequantized by a Triton pass (bitwise the reference's) and cuBLAS, or with
    `fp8_activations` from SCALED_MM_MIN_ROWS rows torch's blockwise FP8 GEMM; the reference elsewhere."""
    rows = x.numel() // x.shape[-1]
    if triton is None or not x.is_cuda:
        return fp8_linear_reference(x, weight, scale, block)
    if rows <= TRITON_MAX_ROWS.get(block, 16):
        return fp8_linear_triton(x, weight, scale, block)
    if fp8_activations and rows >= SCALED_MM_MIN_ROWS and scaled_mm_supported(x, weight, block):
        return fp8_linear_scaled_mm(x, weight, scale, block)
    return fp8_linear_dequant(x, weight, scale, block)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                       block: int = FP8_BLOCK) -> torch.Tensor:
    """A block-diagonal projection held as released (attention's o_a_proj): x [..., groups * K], weight
    [groups * N_g, K] fp8 (group g's rows read x's g-th run of K columns), scale per block x block tile
    -> [..., groups * N_g] in x's dtype. Decode-sized x on the GPU: the split-K kernel, each column tile
    reading its group's run of x (one launch; half the bytes of the bf16 copy serving used to hold);
    elsewhere `fp8_grouped_linear_reference` (the Triton dequantization pass on the GPU)."""
    rows = x.numel() // x.shape[-1]
    n, k = weight.shape
    if triton is None or not x.is_cuda:
        return fp8_grouped_linear_reference(x, weight, scale, groups, block)
    if rows <= TRITON_MAX_ROWS.get(block, 16) and (n // groups) % decode_config(block, rows).block_n == 0:
        return fp8_grouped_linear_triton(x, weight, scale, groups, block)
    return grouped_product(x, dequantize_fp8_blocks_triton(weight, scale, block, x.dtype), groups)


def fp8_grouped_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                              block: int = FP8_BLOCK, config: DecodeConfig | None = None) -> torch.Tensor:
    """`fp8_grouped_linear` by the split-K kernel (one launch); N / groups a multiple of the column tile."""
    n, k = weight.shape
    out = _split_k(x.reshape(-1, groups * k), [(weight, scale)], block, config, True, groups)
    return out.view(*x.shape[:-1], n)


def fp8_grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                                 block: int = FP8_BLOCK) -> torch.Tensor:
    """W dequantized (each value x its block's scale, rounded to x's dtype), then each group's product."""
    return grouped_product(x, dequantize_fp8_blocks(weight, scale, block).to(x.dtype), groups)


def grouped_product(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [..., groups * K] by the block-diagonal weight [groups * N_g, K] -> [..., groups * N_g] (a dense
    GroupedLinear, or an FP8 one dequantized)."""
    grouped = x.reshape(-1, groups, weight.shape[1])
    product = torch.einsum("ngi,gri->ngr", grouped, weight.view(groups, -1, weight.shape[1]))
    return product.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_dequant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The reference with its dequantization in one Triton pass (fp8 read, x's dtype written): the same
    W in x's dtype bit for bit, then the same F.linear, so the same result."""
    return F.linear(x, dequantize_fp8_blocks_triton(weight, scale, block, x.dtype))


def dequantize_fp8_blocks_triton(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """dequantize_fp8_blocks(weight, scale, block).to(dtype) in one pass: value x scale in float32,
    rounded to dtype (round to nearest even, as .to does)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    scales = _as_float_scales(scale).contiguous()
    hw = not _interpreting()
    grid = (triton.cdiv(n, DEQUANT_ROWS), triton.cdiv(k, DEQUANT_COLS))
    _dequantize_kernel[grid](weight if hw else weight.view(torch.uint8), scales, out, n, k, scales.shape[1],
                             BLOCK=block, ROWS=DEQUANT_ROWS, COLS=DEQUANT_COLS, HW_CVT=hw, num_warps=4)
    return out


DEQUANT_ROWS, DEQUANT_COLS = 16, 256


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor, block: int) -> bool:
    n, k = weight.shape
    return (block == 128 and x.dtype == torch.bfloat16 and k % 128 == 0 and n % 16 == 0
            and hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(x.device) == (9, 0))


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """x to e4m3 per 1 x 128 group, then F.scaled_mm (BlockWise1x128 x BlockWise128x128); the rows
    padded to a multiple of 16 (cuBLASLt's fp8 requirement). fp8_linear_w8a8_reference computes the
    same function in float32."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = -(-m // 16) * 16
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    values, x_scale = quantize_fp8_groups(rows.contiguous(), 128)
    kinds, swizzle = F.ScalingType, F.SwizzleType
    out = F.scaled_mm(values, weight.t(), x_scale.t(), kinds.BlockWise1x128, _as_float_scales(scale).t(),
                      kinds.BlockWise128x128, swizzle_a=swizzle.NO_SWIZZLE, swizzle_b=swizzle.NO_SWIZZLE,
                      output_dtype=x.dtype)
    return out[:m].view(*x.shape[:-1], n)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    return F.linear(x, dequantize_fp8_blocks(weight, scale, block).to(x.dtype))


def decode_config(block: int, rows: int) -> DecodeConfig:
    """The split-K kernel's config for `rows` rows of x and `block` x `block` scales (DECODE_CONFIGS;
    a block size it lacks takes the 128 rows' shape with one scale block a K step)."""
    table = DECODE_CONFIGS.get(block)
    if table is None:
        config = DECODE_CONFIGS[128][-1][1]
        return config._replace(block_k=block)
    return next((config for most, config in table if rows <= most), table[-1][1])


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                      config: DecodeConfig | None = None, last_sums: bool = True) -> torch.Tensor:
    """`fp8_linear_reference` by the split-K kernel; `config` None: decode_config(block, rows).
    `last_sums`: a tile's last share adds the shares (one launch) where the counters allow; False: a
    second kernel adds them (the same bits; kept to measure the difference)."""
    k = weight.shape[1]
    out = _split_k(x.reshape(-1, k), [(weight, scale)], block, config, last_sums)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_pair(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor],
                    block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_linear(x, *first), fp8_linear(x, *second)) for two weights that read the same x (q_a and
    kv, a shared expert's gate and up): one split-K launch over both where x is decode-sized, which at
    a batch of 1 costs about one launch's latency instead of two. The results are column slices of one
    [rows, N1 + N2] tensor, the same values `fp8_linear` gives each; elsewhere two calls."""
    (w1, s1), (w2, s2) = first, second
    rows = x.numel() // x.shape[-1]
    config = decode_config(block, rows)
    fused = (triton is not None and x.is_cuda and rows <= TRITON_MAX_ROWS.get(block, 16)
             and w1.shape[1] == w2.shape[1] and w1.shape[0] % config.block_n == 0)
    if not fused:
        return fp8_linear(x, w1, s1, block), fp8_linear(x, w2, s2, block)
    return fp8_linear_pair_triton(x, first, second, block, config)


def fp8_linear_pair_triton(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor],
                           second: tuple[torch.Tensor, torch.Tensor], block: int = FP8_BLOCK,
                           config: DecodeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_linear_pair` by one split-K launch; first's N a multiple of the config's column tile."""
    n1 = first[0].shape[0]
    out = _split_k(x.reshape(-1, x.shape[-1]), [first, second], block, config, True)
    return out[:, :n1].view(*x.shape[:-1], n1), out[:, n1:].view(*x.shape[:-1], second[0].shape[0])


def _split_k(rows: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], block: int, config: DecodeConfig | None,
             last_sums: bool, groups: int = 1) -> torch.Tensor:
    """rows [M, groups * K] times one or two (W [N_i, K] fp8, scale) side by side -> [M, N_1 (+ N_2)] in
    rows' dtype; with groups > 1 (one W), output column c reads x's run c // (N / groups) of K columns."""
    rows = rows.contiguous()
    m = rows.shape[0]
    k = parts[0][0].shape[1]
    n = sum(weight.shape[0] for weight, _ in parts)
    if rows.shape[1] != groups * k or (groups > 1 and len(parts) > 1):
        raise ValueError(f"x of {rows.shape[1]} columns for {groups} group(s) of {k}")
    config = config or decode_config(block, m)
    if config.block_k % block and block % config.block_k:
        raise ValueError(f"K step {config.block_k}: a multiple or a divisor of the {block} scale block")
    if len(parts) == 2 and (parts[0][0].shape[0] % config.block_n or parts[0][0].shape[1] != parts[1][0].shape[1]):
        raise ValueError(f"a pair needs the first N a multiple of the {config.block_n}-column tile and one K")
    if groups > 1 and (n % groups or (n // groups) % config.block_n):
        raise ValueError(f"{groups} groups of {n} / {groups} columns: each a multiple of the {config.block_n}-column tile")
    tiles = triton.cdiv(m, BLOCK_M) * sum(triton.cdiv(weight.shape[0], config.block_n) for weight, _ in parts)
    k_steps = triton.cdiv(k, config.block_k)
    split = max(1, min(k_steps, config.programs // max(tiles, 1)))
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if not m:
        return out
    partial = torch.empty(split, m, n, dtype=torch.float32, device=rows.device) if split > 1 else out
    counters = tile_counters(rows.device, tiles) if last_sums and split > 1 else None
    hw = not _interpreting()
    weights = [weight if hw else weight.view(torch.uint8) for weight, _ in parts]
    scales = [scale.float().contiguous() for _, scale in parts]
    pair = len(parts) == 2
    _fp8_linear_kernel[(triton.cdiv(m, BLOCK_M), tiles // triton.cdiv(m, BLOCK_M), split)](
        rows, weights[0], scales[0], weights[-1], scales[-1], partial, out,
        partial if counters is None else counters, m, n, parts[0][0].shape[0], n // groups, k, groups * k,
        scales[0].shape[1], steps_per_split, split, BLOCK=block, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, HW_CVT=hw,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", LAST_SUMS=counters is not None, PAIR=pair,
        num_warps=config.warps, num_stages=config.stages,
    )
    if split > 1 and counters is None:
        _sum_shares_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](partial, out, m * n, split, BLOCK=SUM_BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _scaled_w_tile(w_ptr, scale_ptr, cols, in_cols, start, k, k_blocks, dtype, BLOCK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr):
        """W[cols, start:start + BLOCK_K] as `dtype`, each value times its block's scale and rounded
        (the reference's rounding); columns past k read as 0. BLOCK_K a divisor of BLOCK: one scale a
        row; a multiple: SUB = BLOCK_K / BLOCK of them."""
        inner = start + tl.arange(0, BLOCK_K)
        raw = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + inner[None, :],
                      mask=in_cols[:, None] & (inner < k)[None, :], other=0.0)
        if HW_CVT:  # the GPU's e4m3 -> float conversion (exact, NaN kept); the interpreter decodes bits
            w = raw.to(tl.float32)
        else:
            w = _e4m3_to_float(raw.to(tl.int32))
        SUB: tl.constexpr = BLOCK_K // BLOCK if BLOCK < BLOCK_K else 1
        if SUB == 1:
            s = tl.load(scale_ptr + (cols // BLOCK) * k_blocks + start // BLOCK, mask=in_cols, other=0.0)
            w = w * s[:, None]
        else:
            sub = start // BLOCK + tl.arange(0, SUB)
            s = tl.load(scale_ptr + (cols // BLOCK)[:, None] * k_blocks + sub[None, :],
                        mask=in_cols[:, None] & (sub < k_blocks)[None, :], other=0.0)
            w = tl.reshape(tl.reshape(w, (BLOCK_N, SUB, BLOCK)) * s[:, :, None], (BLOCK_N, BLOCK_K))
        return w.to(dtype)

    # x_stride stays specialized: Triton then knows x's rows are 16-aligned and loads them in vectors
    # (unspecialized, every FP8 launch of a batch-1 step ran ~1.5x slower on the H200)
    @triton.jit(do_not_specialize=["m", "k_blocks", "steps_per_split", "shares", "n_first", "n_group"])
    def _fp8_linear_kernel(x_ptr, w_ptr, scale_ptr, w2_ptr, scale2_ptr, partial_ptr, y_ptr, counter_ptr, m, n, n_first,
                           n_group, k, x_stride, k_blocks, steps_per_split, shares, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr,
                           PRECISION: tl.constexpr, LAST_SUMS: tl.constexpr, PAIR: tl.constexpr):
        """Program (i, j, s): rows tile i, columns tile j, K steps [s * steps_per_split, ...) -> the
        float32 partial sums partial[s, rows, cols], or with one share (a grid of one along axis 2) y
        itself in y's dtype (partial is y then). LAST_SUMS: the tile's last program to finish (its arrival
        counter says so) adds the shares in share order into y, as _sum_shares_kernel would, and resets
        the counter: no second launch, the same bits. m, k_blocks and the steps are not specialized on
        (one compiled kernel for every decode batch and split); the shares start at multiples of
        BLOCK_K, so the loads keep their vector width. PAIR: y's columns [0, n_first) are W's (scale's),
        the rest W2's (scale2's), both of K columns; n_first a multiple of BLOCK_N, so a tile is one
        matrix's. Groups (one W): x's rows are x_stride apart and column tile j reads x's K columns from
        (j * BLOCK_N // n_group) * K (n_group = n: all read the first K)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        tile = tl.program_id(1)
        w_base, scale_base, n_local, column0 = w_ptr, scale_ptr, n, n_first * 0  # int32 in both branches
        if PAIR:
            first_tiles = n_first // BLOCK_N
            if tile >= first_tiles:
                w_base, scale_base, n_local, column0, tile = w2_ptr, scale2_ptr, n - n_first, n_first, tile - first_tiles
            else:
                n_local = n_first
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # W's rows (y's columns minus column0)
        x_base = x_ptr + (tile * BLOCK_N // n_group).to(tl.int64) * k
        share = tl.program_id(2)
        in_rows, in_cols = rows < m, cols < n_local
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = share * steps_per_split * BLOCK_K
        for start in range(first, tl.minimum(first + steps_per_split * BLOCK_K, k), BLOCK_K):
            inner = start + tl.arange(0, BLOCK_K)
            xs = tl.load(x_base + rows[:, None].to(tl.int64) * x_stride + inner[None, :],
                         mask=in_rows[:, None] & (inner < k)[None, :], other=0.0)
            w = _scaled_w_tile(w_base, scale_base, cols, in_cols, start, k, k_blocks, xs.dtype, BLOCK, BLOCK_N, BLOCK_K,
                               HW_CVT)
            acc += tl.dot(xs, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
        offsets = rows[:, None].to(tl.int64) * n + (column0 + cols)[None, :]
        inside = in_rows[:, None] & in_cols[None, :]
        tl.store(partial_ptr + share.to(tl.int64) * m * n + offsets, acc.to(partial_ptr.dtype.element_ty), mask=inside)
        if LAST_SUMS:
            tl.debug_barrier()  # every thread's partial sums stored before the release below
            counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == shares - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for other in range(0, shares):  # L2 reads (.cg): the other shares' sums were written by other SMs
                    total += tl.load(partial_ptr + other * m * n + offsets, mask=inside, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + offsets, total.to(y_ptr.dtype.element_ty), mask=inside)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=["size", "shares"])
    def _sum_shares_kernel(partial_ptr, out_ptr, size, shares, BLOCK: tl.constexpr):
        """out = sum over the shares of partial[share] (in share order, float32), rounded to out's dtype."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < size
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for share in range(0, shares):
            total += tl.load(partial_ptr + offsets + share * size, mask=inside, other=0.0)  # int64: offsets
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=inside)


# Large-M paths (prefill, large decode batches): tensor-core tiles, one program per output tile.
# `fp8_linear_tc`: W decoded to x's dtype in registers (the reference's rounding: each value x its
#   block's scale, rounded to x's dtype), bf16 tensor cores, float32 accumulation; any block size.
# `fp8_linear_w8a8`: x quantized to e4m3 per 1 x block token group (the release's dynamic activation
#   scheme), fp8 tensor cores on both operands, each block's partial dot scaled by the two scales in
#   float32. Not the reference's function: it adds e4m3's rounding of x (~3% per element).
TC_CONFIG = (128, 128, 64, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
W8A8_CONFIG = (128, 128, 128, 8, 3)
GROUP_M = 8  # output tiles walked in groups of 8 row tiles, so a W tile is reused from L2


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def fp8_linear_tc(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    block_m, block_n, block_k, warps, stages = config or TC_CONFIG
    block_k = min(block_k, block) if block % block_k and block_k % block else block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        hw = not _interpreting()
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _fp8_linear_tc_kernel[grid](rows, weight if hw else weight.view(torch.uint8), scale.float().contiguous(), out,
                                    m, n, k, scale.shape[1], BLOCK=block, BLOCK_M=block_m, BLOCK_N=block_n,
                                    BLOCK_K=block_k, GROUP_M=GROUP_M, HW_CVT=hw,
                                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                    num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n)


def quantize_fp8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [K / group, M]): amax / 448 per 1 x group slice (K a
    multiple of group). The scales are stored group-major (M contiguous), torch._scaled_mm's layout."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    values = (groups / scale[..., None]).view(m, k).to(torch.float8_e4m3fn)
    return values, scale.t().contiguous()


def fake_quantize_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] as e4m3 per 1 x group sees it: each value rounded to e4m3 over its group's scale, times
    that scale, in float32."""
    values, scale = quantize_fp8_groups_reference(x, group)
    return values.float() * scale.t().repeat_interleave(group, dim=1)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if triton is None or not x.is_cuda or _interpreting():
        return quantize_fp8_groups_reference(x, group)
    m, k = x.shape
    values = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(k // group, m, dtype=torch.float32, device=x.device)
    if m:
        rows_per = max(1, min(64, 4096 // group))
        _quantize_groups_kernel[(triton.cdiv(m, rows_per), k // group)](x, values, scale, m, k, GROUP=group,
                                                                        BLOCK_R=rows_per, num_warps=4)
    return values, scale


def fp8_linear_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """What `fp8_linear_w8a8` computes: x rounded to e4m3 per 1 x block group, then exact products."""
    n, k = weight.shape
    xs = fake_quantize_fp8_groups(x.reshape(-1, k), block)
    return F.linear(xs, dequantize_fp8_blocks(weight, scale, block)).to(x.dtype).view(*x.shape[:-1], n)


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                    config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """K must be a multiple of `block` (every V4 / V4.1 projection is)."""
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    block_m, block_n, block_k, warps, stages = config or W8A8_CONFIG
    block_k = max(block_k, block) if block_k % block else block_k
    values, x_scale = quantize_fp8_groups(rows, block)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _fp8_linear_w8a8_kernel[grid](values, x_scale, weight, scale.float().contiguous(), out, m, n, k,
                                      scale.shape[1], BLOCK=block, BLOCK_M=block_m, BLOCK_N=block_n,
                                      BLOCK_K=block_k, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _tile_of(m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Program id -> (row tile, column tile), GROUP_M row tiles per column sweep (L2 reuse of W)."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        width = GROUP_M * tiles_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def _fp8_linear_tc_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, m, n, k, k_blocks, BLOCK: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, HW_CVT: tl.constexpr, PRECISION: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] output tile over all of K, BLOCK_K at a time; W's tile decoded and
        scaled in registers (_scaled_w_tile)."""
        tile_m, tile_n = _tile_of(m, n, BLOCK_M, BLOCK_N, GROUP_M)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows, in_cols = rows < m, cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            inner = start + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * k + inner[None, :],
                         mask=in_rows[:, None] & (inner < k)[None, :], other=0.0)
            w = _scaled_w_tile(w_ptr, scale_ptr, cols, in_cols, start, k, k_blocks, xs.dtype, BLOCK, BLOCK_N, BLOCK_K,
                               HW_CVT)
            acc += tl.dot(xs, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_rows[:, None] & in_cols[None, :])

    @triton.jit
    def _dequantize_kernel(w_ptr, scale_ptr, out_ptr, n, k, k_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                           COLS: tl.constexpr, HW_CVT: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        mask = (rows < n)[:, None] & (cols < k)[None, :]
        offsets = rows[:, None].to(tl.int64) * k + cols[None, :]
        raw = tl.load(w_ptr + offsets, mask=mask, other=0.0)
        if HW_CVT:
            w = raw.to(tl.float32)
        else:
            w = _e4m3_to_float(raw.to(tl.int32))
        s = tl.load(scale_ptr + (rows // BLOCK)[:, None] * k_blocks + (cols // BLOCK)[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + offsets, (w * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_groups_kernel(x_ptr, values_ptr, scale_ptr, m, k, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        group = tl.program_id(1)
        inner = group * GROUP + tl.arange(0, GROUP)
        mask = (rows < m)[:, None]
        offsets = rows[:, None].to(tl.int64) * k + inner[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        tl.store(values_ptr + offsets, (x / scale[:, None]).to(tl.float8e4nv), mask=mask)
        tl.store(scale_ptr + group * m + rows, scale, mask=rows < m)

    @triton.jit
    def _fp8_linear_w8a8_kernel(xq_ptr, xs_ptr, w_ptr, scale_ptr, out_ptr, m, n, k, k_blocks, BLOCK: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr):
        """fp8 x fp8 dots BLOCK wide (one scale pair each), SUB = BLOCK_K / BLOCK of them per K step."""
        tile_m, tile_n = _tile_of(m, n, BLOCK_M, BLOCK_N, GROUP_M)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows, in_cols = rows < m, cols < n
        SUB: tl.constexpr = BLOCK_K // BLOCK
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            for j in tl.static_range(SUB):
                inner = start + j * BLOCK + tl.arange(0, BLOCK)
                in_inner = inner < k
                a = tl.load(xq_ptr + rows[:, None].to(tl.int64) * k + inner[None, :],
                            mask=in_rows[:, None] & in_inner[None, :], other=0.0)
                b = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + inner[None, :],
                            mask=in_cols[:, None] & in_inner[None, :], other=0.0)
                kb = start // BLOCK + j
                sa = tl.load(xs_ptr + kb * m + rows, mask=in_rows, other=0.0)
                sb = tl.load(scale_ptr + (cols // BLOCK) * k_blocks + kb, mask=in_cols, other=0.0)
                acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_rows[:, None] & in_cols[None, :])
