"""MXFP4 routed experts with FP8 activations, for prefill (opt-in: `model.prefill_activations: fp8`).

Why: the sorted prefill kernels of kernels/moe_mxfp4.py turn E2M1 codes into bf16 and multiply on the
bf16 tensor cores, so a released checkpoint prefills no faster than its bf16 copy (issue 20: 0.95-1.14x).
Hopper's FP8 tensor cores do twice the operations a cycle on half the bytes, and every E2M1 value is an
e4m3 value. DeepSeek's own inference runs the release this way (activations to e4m3 per 1 x 128, a
float32 scale each); vLLM and SGLang do the same for the FP8 linears of these checkpoints.

What is multiplied, per output row and K step of 128 columns (four E8M0 scale groups of 32):
- the activations: e4m3 per (row, K step), scale amax / 448 (kernels/fp8_linear.py's
  `quantize_fp8_groups`), their columns in `STEP_ORDER` (a step's even columns, then its odd ones, so
  the kernel's two dots read them with plain loads);
- the weights: the step's largest exponent `top` factored out as the float32 2 ** (top - 127); each
  group's codes become the e4m3 values E2M1 x 2 ** (e - top), exact while the group's exponent e is at
  most 8 below top (e4m3's subnormals reach 2 ** -9), rounded to nearest even below that (from 13
  binades down every value rounds to 0). `fp8_weight_reference` is that matrix.
Each K step is its own float32 dot (even columns, then odd), times the rows' activation scales and the
columns' weight scales, added to a float32 accumulator: DeepGEMM's promotion, since Hopper's FP8 MMA
keeps fewer accumulator bits than float32. Not the checkpoint's bf16 function (the activations'
rounding: ~2-3% relative per product), hence opt-in; the result does not depend on which pairs share a
tile (deterministic), as for the bf16 kernels.

The codes become e4m3 two ways (`UPCASTS`): "ptx" (GPU), f16 bit placement, one f16x2 multiply by the
group's 2 ** (14 - shift) and one `cvt.rn.satfinite.e4m3x2.f16x2` per two codes; "lut" (also Triton's
interpreter, whose fp8 conversions truncate), a 14 x 16-byte table of the e4m3 bits per (shift, code).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.fp8_linear import fake_quantize_fp8_groups, quantize_fp8_groups
from kernels.mma_layout import CHUNK, CODE_ORDER, MXFP4MMAExperts
from kernels.moe_mxfp4 import Blocks, Tile, _checked, _SortedTable
from kernels.moe_pairs import pair_table, pair_table_reference, sum_pairs, sum_pairs_reference, swiglu_pairs_reference
from kernels.quant import E2M1_VALUES, MXFP4Experts

try:
    import triton
    import triton.language as tl

    from kernels.moe_mxfp4 import _block_pairs, _code_bytes, _code_rows, _store_activation
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

STEP = CHUNK  # K columns per step: one activation scale, four weight scale groups
E4M3_MAX = 448.0
UPCASTS = ("ptx", "lut")
# a K step's columns as the kernels read them: its even columns, then its odd ones
STEP_ORDER = torch.cat((torch.arange(0, STEP, 2), torch.arange(1, STEP, 2)))
# shifts (top minus a group's exponent) the table holds; from 13 on every code rounds to 0
LUT_SHIFTS = 14

# One tile at every prefill size, from bench.kernels' moe_mxfp4_fp8 sweep (H200, twenty-first session, one
# V4-Flash layer): 64 pairs x 64 rows, 4 warps, 3 stages, 128 registers a thread (4 programs an SM where
# the compiler's choice, 189, allows 2): 4.79 / 7.57 / 12.63 ms at 2,048 / 4,096 / 8,192 tokens, the
# fastest tried at each (128 x 128 with 8 warps and 4 stages: 7.20 / 7.61 / 13.09).
FP8_BLOCKS: Blocks = {"gate_up": Tile(64, 64, STEP, 4, 3, 128), "down": Tile(64, 64, STEP, 4, 3, 128)}


def e4m3_lut() -> torch.Tensor:
    """uint8 [LUT_SHIFTS, 16]: the e4m3 bits of E2M1 code c's value times 2 ** -shift (torch's
    conversion: round to nearest even)."""
    shifts = torch.arange(LUT_SHIFTS, dtype=torch.float32)[:, None]
    return (E2M1_VALUES[None, :] * torch.exp2(-shifts)).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()


def activation_order(mma_layout: bool) -> torch.Tensor:
    """The column order within a K step the kernels read x in: STEP_ORDER of the columns as the codes
    pair them (kernels/mma_layout.py's CODE_ORDER for its layout, as released otherwise)."""
    return CODE_ORDER[STEP_ORDER] if mma_layout else STEP_ORDER


def quantize_steps(x: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] (K a multiple of STEP) -> (e4m3 [rows, K], each step's columns in `order` (on x's
    device); float32 scales [K / STEP, rows])."""
    rows, width = x.shape
    steps = x.reshape(rows, width // STEP, STEP)[:, :, order].reshape(rows, width)
    return quantize_fp8_groups(steps, STEP)


def fp8_weight_reference(w: MXFP4Experts | MXFP4MMAExperts, local: int) -> torch.Tensor:
    """Expert `local`'s matrix [rows, cols] in float32 as the FP8 kernels multiply it: per row and K
    step, 2 ** (top - 127) times the e4m3 rounding of each value over that."""
    full = w.expert(local, torch.float32)
    rows, cols = full.shape
    top = w.scales[local].int().view(rows, cols // STEP, STEP // 32).amax(-1)
    # 2 ** (top - 127) from its float32 bits, as the kernels build it (top = 0: the subnormal 2 ** -127)
    step_scale = torch.clamp(top << 23, min=0x400000).view(torch.float32).repeat_interleave(STEP, dim=1)
    return (full / step_scale).to(torch.float8_e4m3fn).float() * step_scale


def fp8_hidden_reference(x: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, k: int,
                         gate_up: MXFP4Experts | MXFP4MMAExperts, limit: float, weight_before_down: bool
                         ) -> torch.Tensor:
    """The hidden rows [pairs, inter] in bf16 (pair p reads x row p // k; 0 for another rank's pair): x to
    e4m3 per 1 x STEP, gate_up as `fp8_weight_reference`, float32 sums, the clamped SwiGLU."""
    pairs = expert_of.numel()
    xs = fake_quantize_fp8_groups(x.float(), STEP)
    token_of = torch.arange(pairs, device=x.device) // k
    partial = torch.zeros(1, pairs, gate_up.shape[1], dtype=torch.float32, device=x.device)
    for local, mine in _pairs_by_expert(expert_of):
        partial[0, mine] = _exact_product(xs[token_of[mine]], fp8_weight_reference(gate_up, local))
    return swiglu_pairs_reference(partial, expert_of, weight, limit, weight_before_down)


def fp8_down_reference(hidden: torch.Tensor, expert_of: torch.Tensor, down: MXFP4Experts | MXFP4MMAExperts
                       ) -> torch.Tensor:
    """float32 [1, pairs, dim]: each pair's hidden row to e4m3 per 1 x STEP times its expert's down as
    `fp8_weight_reference` (0 for another rank's pair)."""
    pairs = expert_of.numel()
    rows = fake_quantize_fp8_groups(torch.where((expert_of >= 0)[:, None], hidden.float(), 0.0), STEP)
    out = torch.zeros(1, pairs, down.shape[1], dtype=torch.float32, device=hidden.device)
    for local, mine in _pairs_by_expert(expert_of):
        out[0, mine] = _exact_product(rows[mine], fp8_weight_reference(down, local))
    return out


def _exact_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w.T rounded once to float32 (float64 sums: a CUDA float32 matmul may take TF32 inputs, which
    an activation's e4m3 value times its float32 scale does not fit)."""
    return (a.double() @ w.double().t()).float()


def _pairs_by_expert(expert_of: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(local, (expert_of == local).nonzero().flatten()) for local in expert_of.unique().tolist() if local >= 0]


def experts_fp8_reference(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: MXFP4Experts | MXFP4MMAExperts,
    down: MXFP4Experts | MXFP4MMAExperts, first: int, limit: float, weight_before_down: bool,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels/moe.py's experts contract with the FP8 kernels' rounding: x and the hidden rows (bf16, as
    the bf16 kernels hand them to down) to e4m3 per 1 x STEP, weights as `fp8_weight_reference`,
    products summed in float32."""
    k = experts.shape[1]
    expert_of, weight = pair_table_reference(experts, weights, first, gate_up.shape[0])
    hidden = fp8_hidden_reference(x, expert_of, weight, k, gate_up, limit, weight_before_down)
    return sum_pairs_reference(fp8_down_reference(hidden, expert_of, down), expert_of, weight, k, weight_before_down,
                               residual)


class DeviceTables(NamedTuple):
    """What the kernels read besides their operands, made once per device (a copy to the GPU per call
    would sync the host): the e4m3 table and the activations' column orders."""

    lut: torch.Tensor
    steps: torch.Tensor  # STEP_ORDER (the hidden rows, already in their codes' order)
    mma: torch.Tensor  # activation_order(True)
    released: torch.Tensor  # activation_order(False)


@functools.cache
def device_tables(device: torch.device) -> DeviceTables:
    return DeviceTables(*(t.to(device) for t in (e4m3_lut(), STEP_ORDER, activation_order(True),
                                                  activation_order(False))))


@dataclass(frozen=True)
class SortedPairs:
    """A chunk's (token, expert) pairs as the FP8 kernels take them: kernels/moe_pairs.py's pair table
    and kernels/moe_mxfp4.py's blocks of one expert (`block_m` pairs at most), `k` pairs a token."""

    expert_of: torch.Tensor
    weight: torch.Tensor
    table: _SortedTable
    tokens: int
    k: int

    @classmethod
    def build(cls, experts: torch.Tensor, weights: torch.Tensor, first: int, held: int, block_m: int) -> SortedPairs:
        expert_of, weight = pair_table(experts, weights, first, held)
        return cls(expert_of, weight, _SortedTable.build(expert_of, held, block_m), *experts.shape)

    @property
    def operands(self) -> tuple[torch.Tensor, ...]:
        table = self.table
        return table.order, table.block_expert, table.block_start, table.block_end


def widths_fit(gate_up: MXFP4Experts | MXFP4MMAExperts) -> bool:
    """Whether the experts' dim and inter are multiples of STEP, as the kernels need."""
    _, double_inter, dim = gate_up.shape
    return not dim % STEP and not double_inter % (2 * STEP)


def experts_sorted_fp8(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: MXFP4Experts | MXFP4MMAExperts,
    down: MXFP4Experts | MXFP4MMAExperts, first: int, limit: float, weight_before_down: bool,
    residual: torch.Tensor | None = None, *, blocks: Blocks | None = None, upcast: str | None = None,
) -> torch.Tensor:
    """`experts_fp8_reference` on the GPU (or Triton's interpreter): `fp8_hidden`, `fp8_down` and
    kernels/moe_pairs.py's sum. dim and inter: multiples of STEP. `blocks` None: FP8_BLOCKS."""
    held, double_inter, dim = gate_up.shape
    if not widths_fit(gate_up):
        raise ValueError(f"experts of {dim} x {double_inter // 2}: the FP8 kernels take multiples of {STEP}")
    blocks = blocks or FP8_BLOCKS
    tiles = Tile(*blocks["gate_up"]), Tile(*blocks["down"])
    if tiles[0].block_m != tiles[1].block_m or any(tile.block_k != STEP for tile in tiles):
        raise ValueError(f"the FP8 kernels share one block table (one BLOCK_M) and step K by {STEP}")
    pairs = SortedPairs.build(experts, weights, first, held, tiles[0].block_m)
    hidden = fp8_hidden(x, pairs, gate_up, limit, weight_before_down, tiles[0], upcast)
    out = fp8_down(hidden, pairs, down, tiles[1], upcast)
    return sum_pairs(out, pairs.expert_of, pairs.weight, pairs.k, weight_before_down, residual)


def fp8_hidden(x: torch.Tensor, pairs: SortedPairs, gate_up: MXFP4Experts | MXFP4MMAExperts, limit: float,
               weight_before_down: bool, tile: Tile, upcast: str | None = None) -> torch.Tensor:
    """`fp8_hidden_reference` in one launch: bf16 [pairs, inter], each row's columns in the order down's
    codes pair them (kernels/mma_layout.py's CODE_ORDER for its layout); another rank's rows unwritten."""
    _, double_inter, dim = gate_up.shape
    inter = double_inter // 2
    mma_layout = isinstance(gate_up, MXFP4MMAExperts)
    tables = device_tables(x.device)
    xq, xs = quantize_steps(x.reshape(pairs.tokens, dim).contiguous(), tables.mma if mma_layout else tables.released)
    hidden = torch.empty(pairs.expert_of.numel(), inter, dtype=torch.bfloat16, device=x.device)
    _gate_up_fp8_kernel[(pairs.table.programs, triton.cdiv(inter, tile.block_n))](
        xq, xs, *pairs.operands, pairs.weight, gate_up.codes, gate_up.scales, tables.lut, hidden,
        pairs.expert_of.numel(), pairs.tokens, pairs.k, dim, inter, limit, WEIGHT_BEFORE_DOWN=weight_before_down,
        UPCAST=_checked(upcast, UPCASTS, "lut"), MMA_LAYOUT=mma_layout, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=STEP, **tile.launch,
    )
    return hidden


def fp8_down(hidden: torch.Tensor, pairs: SortedPairs, down: MXFP4Experts | MXFP4MMAExperts, tile: Tile,
             upcast: str | None = None) -> torch.Tensor:
    """`fp8_down_reference` in one launch (hidden as `fp8_hidden` writes it): float32 [1, pairs, dim],
    another rank's rows unwritten."""
    _, dim, inter = down.shape
    count = pairs.expert_of.numel()
    tables = device_tables(hidden.device)
    hq, hs = quantize_steps(hidden, tables.steps)  # in the codes' order already
    out = torch.empty(1, count, dim, dtype=torch.float32, device=hidden.device)
    _down_fp8_kernel[(pairs.table.programs, triton.cdiv(dim, tile.block_n))](
        hq, hs, *pairs.operands, down.codes, down.scales, tables.lut, out, count, dim, inter,
        UPCAST=_checked(upcast, UPCASTS, "lut"), MMA_LAYOUT=isinstance(down, MXFP4MMAExperts), BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=STEP, **tile.launch,
    )
    return out


if triton is not None:
    _LUT_SHIFTS = tl.constexpr(LUT_SHIFTS)

    # 8 codes (4 bytes: byte i's low nibble is an even column, its high nibble the odd one) -> 4 + 4 e4m3.
    # $2: the code bytes; $3, $4: f16x2 factors 2 ** (14 - shift) of bytes (0, 1), (2, 3). Out: $0 the four
    # even codes, $1 the four odd ones, as e4m3 bytes in byte order.
    # - prmt spreads bytes 0, 1 (then 2, 3) into the 16-bit lanes of t, each at lane bits 0-7.
    # - A nibble's magnitude bits go to f16 bits 11-9 and its sign to bit 15 (lane mask 0x8E00): the low
    #   nibble (t & 0xF) by << 9 and << 12, the high one (t & 0xF0) by << 5 and << 8, each shift's other
    #   bits outside the mask, so one lop3, (a | b) & mask, merges them. That f16 is the E2M1 value times
    #   2 ** -14 (exponent field x > 0: 2 ** (x - 15) (1 + m / 2); x = 0: the subnormal m 2 ** -15).
    # - Times 2 ** (14 - shift): exact (E2M1 x 2 ** -shift, an f16 down to shift 22, and from shift 13 on
    #   e4m3 rounds every code to 0 anyway); cvt.rn.satfinite rounds to e4m3 to nearest even, as torch.
    def _nibbles_to_e4m3(lanes: str, mask: str, shifts: tuple[int, int], factor: str, out: str) -> str:
        """One nibble of each 16-bit lane of `lanes` (`mask` picks it, `shifts` place its magnitude and its
        sign) times the f16x2 `factor`, to two e4m3 in the 16-bit `out`."""
        return f"""
    and.b32 n, {lanes}, {mask};
    shl.b32 a, n, {shifts[0]};
    shl.b32 b, n, {shifts[1]};
    lop3.b32 u, a, b, 0x8E008E00, 0xA8;
    mul.rn.f16x2 u, u, {factor};
    cvt.rn.satfinite.e4m3x2.f16x2 {out}, u;"""

    _LOW, _HIGH = ("0x000F000F", (9, 12)), ("0x00F000F0", (5, 8))
    _E2M1_TO_E4M3_PTX = tl.constexpr(
        """{
    .reg .b32 t0, t1, n, a, b, u;
    .reg .b16 h0, h1, h2, h3;
    prmt.b32 t0, $2, 0, 0x4140;
    prmt.b32 t1, $2, 0, 0x4342;"""
        + _nibbles_to_e4m3("t0", *_LOW, "$3", "h0") + _nibbles_to_e4m3("t1", *_LOW, "$4", "h1")
        + "\n    mov.b32 $0, {h0, h1};"
        + _nibbles_to_e4m3("t0", *_HIGH, "$3", "h2") + _nibbles_to_e4m3("t1", *_HIGH, "$4", "h3")
        + "\n    mov.b32 $1, {h2, h3};\n    }"
    )

    @triton.jit
    def _e4m3_codes(codes, shift, lut_ptr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_N, BLOCK_K / 2] code bytes and each scale group's shift [BLOCK_N, BLOCK_K / 32] -> the
        e4m3 weights over 2 ** (top - 127) as (even columns, odd columns), two [BLOCK_N, BLOCK_K / 2]."""
        grouped = codes.reshape(BLOCK_N, BLOCK_K // 32, 16)
        if UPCAST == "ptx":
            # the f16 2 ** (14 - shift): exponent field 29 - shift (0 from shift 29 on: every code is 0 then)
            factor = tl.where(shift < 29, (29 - shift) << 10, 0).to(tl.int16).to(tl.float16, bitcast=True)
            even, odd = tl.inline_asm_elementwise(
                _E2M1_TO_E4M3_PTX, "=r,=r,r,r,r", [grouped, factor[:, :, None]],
                dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4,
            )
        else:
            byte = grouped.to(tl.int32)
            row = (tl.minimum(shift, _LUT_SHIFTS - 1) * 16)[:, :, None]
            even = tl.load(lut_ptr + row + (byte & 15))
            odd = tl.load(lut_ptr + row + (byte >> 4))
        even = even.reshape(BLOCK_N, BLOCK_K // 2).to(tl.float8e4nv, bitcast=True)
        return even, odd.reshape(BLOCK_N, BLOCK_K // 2).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _accumulate_fp8(acc, a_even, a_odd, a_scale, codes_ptr, scales_ptr, lut_ptr, rows, in_rows, start, n_cols,
                        UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA_LAYOUT: tl.constexpr):
        """acc + (a [BLOCK_M, BLOCK_K] @ W[rows, start:start + BLOCK_K].T) with a as (even, odd) e4m3
        columns times its rows' scales a_scale, W's step decoded as `_e4m3_codes` times its rows' 2 ** (top - 127)."""
        group = start // 32 + tl.arange(0, BLOCK_K // 32)
        codes = _code_bytes(codes_ptr, rows, in_rows, start, n_cols, BLOCK_K, MMA_LAYOUT)
        exponent = tl.load(scales_ptr + rows[:, None] * (n_cols // 32) + group[None, :], mask=in_rows[:, None],
                           other=127).to(tl.int32)
        top = tl.max(exponent, axis=1)
        even, odd = _e4m3_codes(codes, top[:, None] - exponent, lut_ptr, UPCAST, BLOCK_N, BLOCK_K)
        part = tl.dot(a_even, tl.trans(even), out_dtype=tl.float32)
        part = tl.dot(a_odd, tl.trans(odd), part, out_dtype=tl.float32)
        # 2 ** (top - 127) from its float32 bits (top = 0: the subnormal 2 ** -127)
        w_scale = tl.maximum(top << 23, 0x400000).to(tl.float32, bitcast=True)
        return acc + part * a_scale[:, None] * w_scale[None, :]

    @triton.jit
    def _step_operands(q_ptr, s_ptr, row, valid, start, width, rows_total, BLOCK_K: tl.constexpr):
        """Row `row`'s K step at `start` of an activation from `quantize_steps`: (even e4m3 columns, odd ones,
        the step's scale)."""
        half = start + tl.arange(0, BLOCK_K // 2)
        base = q_ptr + row.to(tl.int64)[:, None] * width + half[None, :]
        a_even = tl.load(base, mask=valid[:, None], other=0.0)
        a_odd = tl.load(base + BLOCK_K // 2, mask=valid[:, None], other=0.0)
        scale = tl.load(s_ptr + (start // BLOCK_K) * rows_total + row, mask=valid, other=0.0)
        return a_even, a_odd, scale

    @triton.jit(do_not_specialize=["pairs", "tokens"])
    def _gate_up_fp8_kernel(
        xq_ptr, xs_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weight_ptr, codes_ptr,
        scales_ptr, lut_ptr, hidden_ptr, pairs, tokens, k, dim, inter, limit, WEIGHT_BEFORE_DOWN: tl.constexpr,
        UPCAST: tl.constexpr, MMA_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Program (block, row block): gate and up over all of K, then the SwiGLU (and the routing weight
        where it comes before down) to hidden[pair, rows] in bf16, in down's code order
        (kernels/moe_mxfp4.py's `_code_rows`)."""
        limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
        expert, pair, valid = _block_pairs(order_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                                           pairs, True, BLOCK_M)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < inter
        weight_rows = _code_rows(rows, MMA_LAYOUT)
        token = pair // k
        base = tl.maximum(expert, 0).to(tl.int64) * 2 * inter
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, tl.where(expert >= 0, dim, 0), BLOCK_K):
            a_even, a_odd, a_scale = _step_operands(xq_ptr, xs_ptr, token, valid, start, dim, tokens, BLOCK_K)
            gate = _accumulate_fp8(gate, a_even, a_odd, a_scale, codes_ptr, scales_ptr, lut_ptr, base + weight_rows,
                                   in_rows, start, dim, UPCAST, BLOCK_N, BLOCK_K, MMA_LAYOUT)
            up = _accumulate_fp8(up, a_even, a_odd, a_scale, codes_ptr, scales_ptr, lut_ptr,
                                 base + inter + weight_rows, in_rows, start, dim, UPCAST, BLOCK_N, BLOCK_K, MMA_LAYOUT)
        _store_activation(hidden_ptr, weight_ptr, gate, up, pair, rows, valid, valid[:, None] & in_rows[None, :],
                          inter, limit, WEIGHT_BEFORE_DOWN)

    @triton.jit(do_not_specialize=["pairs"])
    def _down_fp8_kernel(
        hq_ptr, hs_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, codes_ptr, scales_ptr,
        lut_ptr, out_ptr, pairs, dim, inter, UPCAST: tl.constexpr, MMA_LAYOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (block, row block): the down product over all of K to out[0, pair, rows] in float32,
        unweighted (kernels/moe_pairs.py's sum applies the routing weights)."""
        expert, pair, valid = _block_pairs(order_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                                           pairs, True, BLOCK_M)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < dim
        base = tl.maximum(expert, 0).to(tl.int64) * dim
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, tl.where(expert >= 0, inter, 0), BLOCK_K):
            a_even, a_odd, a_scale = _step_operands(hq_ptr, hs_ptr, pair, valid, start, inter, pairs, BLOCK_K)
            acc = _accumulate_fp8(acc, a_even, a_odd, a_scale, codes_ptr, scales_ptr, lut_ptr, base + rows, in_rows,
                                  start, inter, UPCAST, BLOCK_N, BLOCK_K, MMA_LAYOUT)
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * dim + rows[None, :], acc,
                 mask=valid[:, None] & in_rows[None, :])
