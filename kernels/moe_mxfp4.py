"""MXFP4 routed experts on tensor cores, each chosen expert's weights read once per step.

The pairwise kernels (kernels/moe.py) run one program per (token, expert) pair and decode the E2M1
codes one value at a time on the CUDA cores: a batch of 32 tokens decodes and streams ~192 expert
matrices where ~139 distinct ones exist, and the decoding arithmetic, not memory, bounds them (issue
20: 7.5% of the bandwidth roofline at batch 32). Here one program owns one (expert, block of output
rows) and multiplies every pair routed to that expert at once: a [pairs, K] x [K, rows] product on the
tensor cores, the codes expanded to bf16 in registers (`UPCASTS`: `tl.dot_scaled`, Triton's E2M1 + E8M0
upcast; the bit decode below in Triton operations; or the inline-PTX decode below, 8 codes a 32-bit
word), so an expert's bytes cross the memory bus once however many tokens chose it.

Two ways to find an expert's pairs, one kernel body:
- decode (`experts_by_expert`, up to MAX_SCAN_PAIRS pairs): program (pair, row block) works only if its
  pair is the (j x BLOCK_M)-th one routed to its expert; it scans the step's expert ids for that
  expert's next BLOCK_M pairs. No sort, no host sync, two launches per layer (and the pair table and sum): a decode
  step can be captured. At a few tokens that leaves most SMs idle (6 experts x 16 row blocks of 128 is
  96 programs for 132 SMs), so each GEMM can also split K into shares (`DECODE_SPLITS`, by pair count):
  the shares' float32 partial sums go to a [shares, pairs, rows] buffer and one small kernel adds them
  in share order (then SiLU * up for gate_up, whose activation needs the whole sum; for down, at any
  share count, kernels/moe_pairs.py's sum: the routing weights and the sum over a token's k experts
  in slot order, plus the shared expert's output where the layer adds it). No atomics, no sync: still
  capturable, and a replay gives its eager run's bits.
- prefill (`experts_sorted`): the pairs sorted by expert in torch and cut into blocks of BLOCK_M pairs
  of one expert (a grouped GEMM over sorted tokens).
Each pair's output row depends only on its own activations and its expert (the K order is fixed), so
the sums are the same whichever pairs share a tile: deterministic, and batch-invariant as long as the
K shares are (a DECODE_SPLITS row that changes them with the pair count changes the rounding between
batch sizes; deterministic mode runs the reference loop anyway, models/moe.py). Activations go to the
tensor cores as bf16, as the bf16 model computes them; accumulation is float32.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kernels.mma_layout import CHUNK, MXFP4MMAExperts, in_code_order
from kernels.moe_pairs import pair_table, sum_pairs, swiglu_pairs_triton
from kernels.quant import MXFP4Experts
from kernels.split_k import tile_counters

try:
    import triton
    import triton.language as tl

    from kernels.moe_pairs import _swiglu
    from kernels.quant import _e8m0_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

# pairs (tokens x top-k) up to which the decode kernels scan the step's expert ids in every program
MAX_SCAN_PAIRS = 1024
# how the codes become bf16 for the tensor cores (the first two also run in Triton's interpreter; "ptx"
# is inline PTX, compiled for the GPU only)
UPCASTS = ("dot_scaled", "bits", "ptx")
# expert ids a scanning program reads per step of its scan (one step up to 42 tokens at top-6)
SCAN_CHUNK = 256


class Tile(NamedTuple):
    """One GEMM's program: pairs x output rows x K step, warps, and software-pipelining depth (Triton's
    num_stages: how many K steps of codes, scales and activations are in flight through shared memory
    while one is multiplied; 3 is Triton's default on CUDA), and a register cap a thread (Triton's maxnreg;
    None: the compiler's choice; a lower cap lets more programs share an SM, at the risk of spills). A
    plain 4-tuple is a Tile of 3 stages.
    (W x a^T, the decoded weights as wgmma's register operand, measured 25-45% slower: BENCHMARKS.md,
    fourteenth session.)"""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3
    max_registers: int | None = None

    @property
    def launch(self) -> dict[str, int]:
        """Triton's launch options for this tile."""
        options = {"num_warps": self.warps, "num_stages": self.stages}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


# Tile per GEMM and the upcast, from bench.kernels' moe_mxfp4 sweep on the H200 (BENCHMARKS.md): the PTX
# upcast was the fastest at every size; prefill 64 x 64 x 128 (best from 32 to 2048 tokens, 13% behind
# 128 x 128 x 128 with 8 warps at 8192). Decode from `--only mxfp4_decode` (CUDA-graph replays, four
# routings cycled; twelfth session): 16 x 128 x 128 with 2 stages was the best tile from 2 to 32 tokens
# (1062 us at 32 against 1084 with 3 stages) and within 4% of the best at 1 token.
Blocks = dict[str, tuple[int, ...]]
DECODE_BLOCKS: Blocks = {"gate_up": Tile(16, 128, 128, 4, 2), "down": Tile(16, 128, 128, 4, 2)}
PREFILL_BLOCKS: Blocks = {"gate_up": Tile(64, 64, 128, 4, 3), "down": Tile(64, 64, 128, 4, 3)}
# From this many pairs (4,096 tokens at top-6: ~96 pairs an expert of 256) the sorted kernels take larger
# tiles: on the MMA layout (twentieth session, one V4-Flash layer, H200) 128 x 128 x 128 with 8 warps and 4
# stages took 6.27 ms at 4,096 tokens against 8.10 for PREFILL_BLOCKS (12.09 / 13.26 at 8,192 with 3
# stages), but 6.48 against 4.44 at 2,048 tokens (~48 pairs an expert, half of a 128-pair tile idle).
LARGE_PREFILL_PAIRS = 24576
LARGE_PREFILL_BLOCKS: Blocks = {"gate_up": Tile(128, 128, 128, 8, 4), "down": Tile(128, 128, 128, 8, 4)}
# K shares of the decode GEMMs by pair count: (up to this many pairs, gate_up shares, down shares), the
# first row that holds the step's pairs applies; 1 runs the fused kernel (no partial sums). From the
# same sweep at top-6 (so 6 pairs are 1 token): 1 token 82.7 us with (2, 1) against 93.7 unsplit (3
# stages), 2 tokens 128.9 with (4, 2) against 150.9, 4 tokens 216.5 with (2, 1) against 223.6; from 8
# tokens on no split was the fastest.
DECODE_SPLITS: tuple[tuple[int, int, int], ...] = ((6, 2, 1), (12, 4, 2), (24, 2, 1), (MAX_SCAN_PAIRS, 1, 1))


def experts_by_expert(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: MXFP4Experts, down: MXFP4Experts,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None, *,
    blocks: Blocks = DECODE_BLOCKS, upcast: str | None = None, splits: tuple[int, int] | None = None,
    last_sums: bool = True,
) -> torch.Tensor:
    """`experts_reference`'s contract (kernels/moe.py) for bf16 x and MXFP4 weights, at most
    MAX_SCAN_PAIRS pairs. `upcast`: one of UPCASTS (None: "ptx", or "bits" in Triton's interpreter);
    `splits`: K shares of (gate_up, down), at most one a K step (None: DECODE_SPLITS' row);
    `last_sums`: gate_up's last share adds its shares (kernels/split_k.py) where it can; False: a
    second kernel does (the same bits)."""
    tokens, k = experts.shape
    pairs = tokens * k
    if pairs > MAX_SCAN_PAIRS:
        raise ValueError(f"{pairs} (token, expert) pairs: the scanning kernels take at most {MAX_SCAN_PAIRS}")
    expert_of, weight = pair_table(experts, weights, first, gate_up.shape[0])
    table = _ScanTable(expert_of, pairs)
    return _run(x, weight, expert_of, table, gate_up, down, k, limit, weight_before_down, blocks,
                _checked(upcast), splits or decode_splits(pairs), residual, last_sums)


def decode_splits(pairs: int) -> tuple[int, int]:
    """(gate_up, down) K shares for a decode step of `pairs` pairs, from DECODE_SPLITS."""
    return next((gate_up, down) for most, gate_up, down in DECODE_SPLITS if pairs <= most)


def experts_sorted(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: MXFP4Experts, down: MXFP4Experts,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None, *,
    blocks: Blocks | None = None, upcast: str | None = None,
) -> torch.Tensor:
    """The same for any number of pairs (prefill): pairs sorted by expert into blocks of one expert.
    `blocks` None: `prefill_blocks`' for the pair count."""
    tokens, k = experts.shape
    blocks = blocks or prefill_blocks(tokens * k)
    held = gate_up.shape[0]
    expert_of, weight = pair_table(experts, weights, first, held)
    table = _SortedTable.build(expert_of, held, blocks["gate_up"][0])
    if blocks["down"][0] != blocks["gate_up"][0]:
        raise ValueError("the sorted kernels share one block table: gate_up and down need the same BLOCK_M")
    return _run(x, weight, expert_of, table, gate_up, down, k, limit, weight_before_down, blocks,
                _checked(upcast), (1, 1), residual)


def prefill_blocks(pairs: int) -> Blocks:
    """The sorted kernels' tiles for `pairs` (token, expert) pairs: LARGE_PREFILL_BLOCKS from
    LARGE_PREFILL_PAIRS on, PREFILL_BLOCKS below."""
    return LARGE_PREFILL_BLOCKS if pairs >= LARGE_PREFILL_PAIRS else PREFILL_BLOCKS


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _checked(upcast: str | None, upcasts: tuple[str, ...] = UPCASTS, interpreted: str = "bits") -> str:
    """`upcast`, one of `upcasts` (None: "ptx", or `interpreted` in Triton's interpreter)."""
    if upcast is None:
        return interpreted if _interpreting() else "ptx"
    if upcast not in upcasts:
        raise ValueError(f"upcast {upcast!r}: one of {upcasts}")
    if upcast == "ptx" and _interpreting():
        raise ValueError("Triton's interpreter runs no inline PTX: upcast 'ptx' needs the GPU")
    return upcast


class _ScanTable:
    """Decode: the programs find their pairs by scanning `expert_of` (launch grid: one row per pair)."""

    SORTED = False

    def __init__(self, expert_of: torch.Tensor, pairs: int) -> None:
        self.expert_of, self.programs = expert_of, pairs
        self.order = self.block_expert = self.block_start = self.block_end = expert_of  # unused operands


class _SortedTable:
    """Prefill: `order` lists the pairs by expert; block b covers order[block_start[b]:block_end[b]],
    all of expert block_expert[b] (-1: past the last block). Shapes depend only on the pair count."""

    SORTED = True

    def __init__(self, order: torch.Tensor, block_expert: torch.Tensor, block_start: torch.Tensor,
                 block_end: torch.Tensor) -> None:
        self.order, self.block_expert, self.block_start, self.block_end = order, block_expert, block_start, block_end
        self.programs = block_expert.numel()
        self.expert_of = order

    @classmethod
    def build(cls, expert_of: torch.Tensor, held: int, block_m: int) -> _SortedTable:
        pairs = expert_of.numel()
        group = torch.where(expert_of >= 0, expert_of.long(), held)  # other ranks' pairs sort last
        order = torch.argsort(group, stable=True).to(torch.int32)
        counts = torch.zeros(held + 1, dtype=torch.long, device=expert_of.device)
        counts.scatter_add_(0, group, torch.ones_like(group))
        counts = counts[:held]
        blocks = (counts + block_m - 1) // block_m
        block_ends = torch.cumsum(blocks, 0)
        pair_ends = torch.cumsum(counts, 0)
        # sum of ceil(count / block_m) <= pairs / block_m + (experts with a pair)
        most = pairs // block_m + min(pairs, held) + 1
        block = torch.arange(most, device=expert_of.device)
        expert = torch.searchsorted(block_ends, block, right=True)
        inside = expert < held
        expert = expert.clamp(max=held - 1)
        start = pair_ends[expert] - counts[expert] + (block - (block_ends[expert] - blocks[expert])) * block_m
        end = torch.minimum(start + block_m, pair_ends[expert])
        block_expert = torch.where(inside, expert, -1).to(torch.int32)
        return cls(order, block_expert, start.to(torch.int32), end.to(torch.int32))


def _run(
    x: torch.Tensor, weight: torch.Tensor, expert_of: torch.Tensor, table: _ScanTable | _SortedTable,
    gate_up: MXFP4Experts | MXFP4MMAExperts, down: MXFP4Experts | MXFP4MMAExperts, k: int, limit: float, weight_before_down: bool,
    blocks: Blocks, upcast: str, splits: tuple[int, int], residual: torch.Tensor | None, last_sums: bool = True,
) -> torch.Tensor:
    """`weight`: pair_table's (0 for another rank's pair)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the MXFP4 tensor-core experts take bf16 activations, got {x.dtype}")
    pairs = expert_of.numel()
    _, double_inter, dim = gate_up.shape
    inter = double_inter // 2
    x = x.contiguous()
    tables = (expert_of, table.order, table.block_expert, table.block_start, table.block_end, weight)
    mma_layout = isinstance(gate_up, MXFP4MMAExperts)
    if mma_layout and any(Tile(*blocks[g]).block_k != CHUNK for g in ("gate_up", "down")):
        raise ValueError(f"experts in kernels/moe_mxfp4_mma.py's layout need K steps of {CHUNK}")
    if mma_layout:
        x = in_code_order(x)
    shared = dict(SORTED=table.SORTED, UPCAST=upcast, F32_DOT=_interpreting(), MMA_LAYOUT=mma_layout)
    tile = Tile(*blocks["gate_up"])
    shares, share_steps = _shares(dim, tile.block_k, splits[0])
    hidden = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    partial = torch.empty(shares, pairs, double_inter, dtype=torch.float32, device=x.device) if shares > 1 else hidden
    row_blocks = triton.cdiv(inter, tile.block_n)
    counters = tile_counters(x.device, table.programs * row_blocks) if shares > 1 and last_sums else None
    _gate_up_kernel[(table.programs, row_blocks, shares)](
        x, *tables, gate_up.codes, gate_up.scales, partial, hidden, partial if counters is None else counters, pairs,
        k, dim, inter, share_steps, limit, weight_before_down, SPLIT=shares > 1, LAST_SUMS=counters is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        **tile.launch, **shared,
    )
    if shares > 1 and counters is None:
        swiglu_pairs_triton(partial, expert_of, weight, limit, weight_before_down, out=hidden)
    tile = Tile(*blocks["down"])
    shares, share_steps = _shares(inter, tile.block_k, splits[1])
    out = torch.empty(shares, pairs, dim, dtype=torch.float32, device=x.device)  # other ranks' rows stay unread
    _down_kernel[(table.programs, triton.cdiv(dim, tile.block_n), shares)](
        hidden, *tables, down.codes, down.scales, out, pairs, dim, inter, share_steps,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, **tile.launch, **shared,
    )
    return sum_pairs(out, expert_of, weight, k, weight_before_down, residual)


def _shares(width: int, block_k: int, wanted: int) -> tuple[int, int]:
    """(shares, K steps per share) for a K of `width`: at most `wanted` shares, none empty."""
    steps = triton.cdiv(width, block_k)
    per = triton.cdiv(steps, max(1, min(wanted, steps)))
    return triton.cdiv(steps, per), per


if triton is not None:
    _SCAN = tl.constexpr(SCAN_CHUNK)

    @triton.jit
    def _mxfp4_as_bf16(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_N, BLOCK_K / 2] code bytes (low nibble = even column) and [BLOCK_N, BLOCK_K / 32] E8M0
        exponents -> the bf16 weights [BLOCK_N, BLOCK_K]. An E2M1 code's 3 magnitude bits placed at
        bits 9-11 of a float16 are its value times 2 ** -14 (exponent 0 lands on float16's subnormals,
        which convert exactly), its sign at bit 15: a few integer ops and one conversion a value."""
        byte = codes.to(tl.int16)
        nibble = tl.join(byte & 15, (byte >> 4) & 15).reshape(BLOCK_N, BLOCK_K)
        half = (((nibble & 7) << 9) | ((nibble & 8) << 12)).to(tl.float16, bitcast=True)
        scale = _e8m0_to_float(scales.to(tl.int32))
        value = (half.to(tl.float32) * 16384.0).reshape(BLOCK_N, BLOCK_K // 32, 32) * scale[:, :, None]
        return value.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)

    # 8 codes -> bf16 in 22 instructions, 8 of them on the integer ALU (shl and mul.lo run as IMAD on the
    # FMA pipe, as the bf16 multiplies do). $4: 4 code bytes (codes 2i, 2i + 1: byte i's low, high
    # nibble); $5, $6: the bf16x2 scales of bytes (0, 1), (2, 3). Out: $0, $1 the even codes (0, 2),
    # (4, 6) as bf16x2; $2, $3 the odd codes (1, 3), (5, 7).
    # - prmt spreads bytes 0, 1 (then 2, 3) into the 16-bit lanes of t, each at lane bits 0-7.
    # - Each code's magnitude bits (exponent x1 x0, mantissa m) go to bf16 bits 8-6 and its sign to bit
    #   15, the lane mask 0x81C0: the low nibble from t << 6 (bits 2-0 to 8-6) and t << 12 (bit 3 to 15),
    #   each zero in the bits the mask takes from the other, so one lop3, (a | b) & mask, merges them; the
    #   high nibble (masked out of t) from t x 0x104 = (t << 2) + (t << 8), two shifts with disjoint bits.
    #   That bf16 is the E2M1 value times 2 ** -126 for every code: exponent field x > 0 gives
    #   2 ** (x - 127) (1 + m / 2) = 2 ** -126 [2 ** (x - 1) (1 + m / 2)], and x = 0 (code 1, 0.5) the
    #   bf16 subnormal (m / 2) 2 ** -126; codes 0 and 8 give +0 and -0.
    # - Times 2 ** 126 (bf16 0x7E80): exact, as the products are normal bf16s and bf16 mul keeps
    #   subnormal inputs (it has no flush-to-zero form). Then times the scale 2 ** (e - 127), exact down
    #   to 0.5 x 2 ** -127 = 2 ** -128 (an E2M1 value has at most 2 significant bits, which a bf16
    #   subnormal holds), overflowing to inf where the reference's float32 product does (bf16 has
    #   float32's exponent range).
    _E2M1_TO_BF16_PTX = tl.constexpr("""{
    .reg .b32 t0, t1, a, b, u, bias;
    mov.b32 bias, 0x7E807E80;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    shl.b32 a, t0, 6;
    shl.b32 b, t0, 12;
    lop3.b32 u, a, b, 0x81C081C0, 0xA8;
    mul.rn.bf16x2 u, u, bias;
    mul.rn.bf16x2 $0, u, $5;
    shl.b32 a, t1, 6;
    shl.b32 b, t1, 12;
    lop3.b32 u, a, b, 0x81C081C0, 0xA8;
    mul.rn.bf16x2 u, u, bias;
    mul.rn.bf16x2 $1, u, $6;
    and.b32 t0, t0, 0x00F000F0;
    mul.lo.u32 t0, t0, 0x104;
    and.b32 u, t0, 0x81C081C0;
    mul.rn.bf16x2 u, u, bias;
    mul.rn.bf16x2 $2, u, $5;
    and.b32 t1, t1, 0x00F000F0;
    mul.lo.u32 t1, t1, 0x104;
    and.b32 u, t1, 0x81C081C0;
    mul.rn.bf16x2 u, u, bias;
    mul.rn.bf16x2 $3, u, $6;
    }""")

    @triton.jit
    def _mxfp4_as_bf16_ptx(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The same weights as (even columns, odd columns), two [BLOCK_N, BLOCK_K / 2] tiles, from the PTX
        above (sm_90: mul.bf16x2). Each output element depends on its own code byte and scale only, so
        any 4 elements Triton packs into a call (pack=4) come out right, and each output register holds
        two neighbours of one tile, as the tensor cores read them: joined into columns 2j, 2j + 1 they
        would need a byte permute per two values, so the caller multiplies each tile by the matching
        activation columns instead. Scales: E8M0 e -> the bf16 bits of 2 ** (e - 127): e << 7, or for
        e = 0 the subnormal 2 ** -127, 0x0040, the larger of the two (e = 255: inf, as the reference's)."""
        exponent = scales.to(tl.int32)
        scale = tl.maximum(exponent << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)
        even, odd = tl.inline_asm_elementwise(
            _E2M1_TO_BF16_PTX, "=r,=r,=r,=r,r,r,r", [codes.reshape(BLOCK_N, BLOCK_K // 32, 16), scale[:, :, None]],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
        return even.reshape(BLOCK_N, BLOCK_K // 2), odd.reshape(BLOCK_N, BLOCK_K // 2)

    @triton.jit
    def _code_rows(rows, MMA_LAYOUT: tl.constexpr):
        """The weight rows whose outputs gate_up writes at output columns `rows`: the same, or for
        kernels/mma_layout.py's layout in its CODE_ORDER (each run of 4 as rows 0, 2, 1, 3), so down
        reads its activations in its codes' order with plain loads."""
        if MMA_LAYOUT:
            return rows - rows % 4 + 2 * (rows % 2) + (rows % 4) // 2
        return rows

    @triton.jit
    def _code_bytes(codes_ptr, rows, in_rows, start, n_cols, BLOCK_K: tl.constexpr, MMA_LAYOUT: tl.constexpr):
        """W[rows, start:start + BLOCK_K]'s code bytes [len(rows), BLOCK_K / 2] as stored, byte j holding
        the codes of columns 2j, 2j + 1 of the activations as the kernels read them, of scale group
        j // 16 either way. Released layout: those columns. kernels/mma_layout.py's layout (BLOCK_K = its
        CHUNK): row r's 64 bytes of a chunk lie at tile r // 8, row r % 8, and the activations come in
        its CODE_ORDER."""
        half = start // 2 + tl.arange(0, BLOCK_K // 2)
        mask = in_rows[:, None] & (half < n_cols // 2)[None, :]
        if MMA_LAYOUT:
            tile = ((rows // 8).to(tl.int64) * (n_cols // BLOCK_K) + start // BLOCK_K) * (4 * BLOCK_K) + (rows % 8) * (BLOCK_K // 2)
            return tl.load(codes_ptr + tile[:, None] + tl.arange(0, BLOCK_K // 2)[None, :], mask=mask, other=0)
        return tl.load(codes_ptr + rows[:, None] * (n_cols // 2) + half[None, :], mask=mask, other=0)

    @triton.jit
    def _accumulate(acc, a, codes_ptr, scales_ptr, rows, in_rows, start, n_cols,
                    UPCAST: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MMA_LAYOUT: tl.constexpr):
        """acc + a [BLOCK_M, BLOCK_K] @ W[rows, start:start + BLOCK_K].T for MXFP4 rows of `n_cols`
        columns (`rows` counted from the stacked experts' first row; columns past n_cols read as 0), a's
        columns in `_code_bytes`' order."""
        group = start // 32 + tl.arange(0, BLOCK_K // 32)
        codes = _code_bytes(codes_ptr, rows, in_rows, start, n_cols, BLOCK_K, MMA_LAYOUT)
        scales = tl.load(scales_ptr + rows[:, None] * (n_cols // 32) + group[None, :],
                         mask=in_rows[:, None] & (group < n_cols // 32)[None, :], other=127)
        if UPCAST == "dot_scaled":
            return tl.dot_scaled(a, None, "bf16", tl.trans(codes), scales, "e2m1", acc)
        if UPCAST == "ptx":  # the sum over K in two halves: even columns, then odd ones
            even, odd = _mxfp4_as_bf16_ptx(codes, scales, BLOCK_N, BLOCK_K)
            a_even, a_odd = tl.split(a.reshape(a.shape[0], BLOCK_K // 2, 2))
            return tl.dot(a_odd, tl.trans(odd), tl.dot(a_even, tl.trans(even), acc))
        w = _mxfp4_as_bf16(codes, scales, BLOCK_N, BLOCK_K)
        if F32_DOT:  # Triton's interpreter multiplies bf16 tiles wrongly; float32 holds these values exactly
            return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        return tl.dot(a, tl.trans(w), acc)

    @triton.jit
    def _block_pairs(expert_of_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, pairs,
                     SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert or -1 for no work, the block's pair ids [BLOCK_M], which of them exist) for
        program_id(0). Scanning: program p works if its pair is the (j x BLOCK_M)-th routed to its
        expert (counted in pair order) and takes that expert's next BLOCK_M pairs, so every expert's
        pairs are covered once, one block per program, without a sort. The ids are read SCAN_CHUNK at a
        time (one compiled kernel for every pair count): a pass for the pair's rank and its expert's
        count, a second for the pairs of its block."""
        program = tl.program_id(0)
        slot = tl.arange(0, BLOCK_M)
        if SORTED:
            expert = tl.load(block_expert_ptr + program)
            rows = tl.load(block_start_ptr + program) + slot
            valid = rows < tl.load(block_end_ptr + program)
            pair = tl.load(order_ptr + rows, mask=valid, other=0)
        else:
            expert = tl.load(expert_of_ptr + program)
            first = 0  # this pair's rank among its expert's pairs
            count = 0  # its expert's pairs in the step
            for start in range(0, pairs, _SCAN):
                index = start + tl.arange(0, _SCAN)
                mine = (tl.load(expert_of_ptr + index, mask=index < pairs, other=-1) == expert).to(tl.int32)
                first += tl.sum(tl.where(index < program, mine, 0))
                count += tl.sum(mine)
            wanted = first + slot
            pair = tl.zeros([BLOCK_M], dtype=tl.int32)
            seen = 0
            for start in range(0, pairs, _SCAN):
                index = start + tl.arange(0, _SCAN)
                mine = (tl.load(expert_of_ptr + index, mask=index < pairs, other=-1) == expert).to(tl.int32)
                rank = seen + tl.cumsum(mine, 0) - 1
                chosen = (mine[None, :] == 1) & (rank[None, :] == wanted[:, None])
                pair += tl.sum(tl.where(chosen, index[None, :], 0), axis=1)
                seen += tl.sum(mine)
            expert = tl.where(first % BLOCK_M == 0, expert, -1)
            valid = wanted < count
        return expert, pair, valid & ((slot * 0 + expert) >= 0)

    @triton.jit(do_not_specialize=["pairs", "share_steps"])
    def _gate_up_kernel(
        x_ptr, expert_of_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weight_ptr,
        codes_ptr, scales_ptr, out_ptr, hidden_ptr, counter_ptr, pairs, k, dim, inter, share_steps, limit,
        WEIGHT_BEFORE_DOWN: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr, SORTED: tl.constexpr, UPCAST: tl.constexpr, F32_DOT: tl.constexpr,
        MMA_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (block, row block, share): gate and up over K steps [share x share_steps, + share_steps). SPLIT:
        their float32 sums to out[share, pair, rows] and [..., inter + rows], and with LAST_SUMS the
        tile's last share to finish (kernels/split_k.py) adds them in share order as
        kernels/moe_pairs.py's swiglu_pairs does, into hidden; else the activation (and the routing weight) to
        hidden[pair, rows] in bf16 (out is hidden then). In kernels/mma_layout.py's layout output column
        `rows` is weight row `_code_rows(rows)`: hidden comes out in the order down's codes need."""
        limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
        expert, pair, valid = _block_pairs(expert_of_ptr, order_ptr, block_expert_ptr, block_start_ptr,
                                           block_end_ptr, pairs, SORTED, BLOCK_M)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < inter
        weight_rows = _code_rows(rows, MMA_LAYOUT)
        token = (pair // k).to(tl.int64)
        base = tl.maximum(expert, 0).to(tl.int64) * 2 * inter
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # K steps, not columns, per share: `begin` is then a known multiple of BLOCK_K, which the loads'
        # vector width (and so their pipelining through cp.async) depends on
        begin = tl.program_id(2) * share_steps * BLOCK_K
        # no work: no K steps (a bound, not a branch, so the loop stays one the compiler pipelines)
        for start in range(begin, tl.where(expert >= 0, tl.minimum(begin + share_steps * BLOCK_K, dim), begin),
                           BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None] * dim + cols[None, :], mask=valid[:, None] & (cols < dim)[None, :],
                        other=0.0)
            gate = _accumulate(gate, a, codes_ptr, scales_ptr, base + weight_rows, in_rows, start, dim,
                               UPCAST, F32_DOT, BLOCK_N, BLOCK_K, MMA_LAYOUT)
            up = _accumulate(up, a, codes_ptr, scales_ptr, base + inter + weight_rows, in_rows, start, dim,
                             UPCAST, F32_DOT, BLOCK_N, BLOCK_K, MMA_LAYOUT)
        both = valid[:, None] & in_rows[None, :]
        if SPLIT:
            row = out_ptr + (tl.program_id(2).to(tl.int64) * pairs + pair.to(tl.int64))[:, None] * 2 * inter
            tl.store(row + rows[None, :], gate, mask=both)
            tl.store(row + inter + rows[None, :], up, mask=both)
            if LAST_SUMS:
                tl.debug_barrier()  # every thread's partial sums stored before the release below
                counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
                    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    for share in range(0, tl.num_programs(2)):  # L2 reads: other SMs wrote these
                        sums = out_ptr + (share * pairs + pair.to(tl.int64))[:, None] * 2 * inter + rows[None, :]
                        gate += tl.load(sums, mask=both, other=0.0, cache_modifier=".cg")
                        up += tl.load(sums + inter, mask=both, other=0.0, cache_modifier=".cg")
                    _store_activation(hidden_ptr, weight_ptr, gate, up, pair, rows, valid, both, inter, limit,
                                      WEIGHT_BEFORE_DOWN)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        else:
            _store_activation(hidden_ptr, weight_ptr, gate, up, pair, rows, valid, both, inter, limit,
                              WEIGHT_BEFORE_DOWN)

    @triton.jit
    def _store_activation(hidden_ptr, weight_ptr, gate, up, pair, rows, valid, both, inter, limit,
                          WEIGHT_BEFORE_DOWN: tl.constexpr):
        """hidden[pair, rows] = the clamped SwiGLU of gate / up [pairs, rows] (times the routing weight
        where it comes before down) in bf16."""
        hidden = _swiglu(gate, up, limit)
        if WEIGHT_BEFORE_DOWN:
            hidden = hidden * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(hidden_ptr + pair.to(tl.int64)[:, None] * inter + rows[None, :], hidden.to(tl.bfloat16), mask=both)

    @triton.jit(do_not_specialize=["pairs", "share_steps"])
    def _down_kernel(
        hidden_ptr, expert_of_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weight_ptr,
        codes_ptr, scales_ptr, out_ptr, pairs, dim, inter, share_steps, SORTED: tl.constexpr, UPCAST: tl.constexpr,
        F32_DOT: tl.constexpr, MMA_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Program (block, row block, share): the down product over K steps [share x share_steps, + share_steps)
        to out[share, pair, rows], unweighted (kernels/moe_pairs.py's sum applies the routing weights)."""
        expert, pair, valid = _block_pairs(expert_of_ptr, order_ptr, block_expert_ptr, block_start_ptr,
                                           block_end_ptr, pairs, SORTED, BLOCK_M)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < dim
        row_of = pair.to(tl.int64)
        base = tl.maximum(expert, 0).to(tl.int64) * dim
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        begin = tl.program_id(2) * share_steps * BLOCK_K
        for start in range(begin, tl.where(expert >= 0, tl.minimum(begin + share_steps * BLOCK_K, inter), begin),
                           BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = tl.load(hidden_ptr + row_of[:, None] * inter + cols[None, :],
                        mask=valid[:, None] & (cols < inter)[None, :], other=0.0)
            acc = _accumulate(acc, a, codes_ptr, scales_ptr, base + rows, in_rows, start, inter,
                              UPCAST, F32_DOT, BLOCK_N, BLOCK_K, MMA_LAYOUT)
        row_of += tl.program_id(2).to(tl.int64) * pairs
        tl.store(out_ptr + row_of[:, None] * dim + rows[None, :], acc, mask=valid[:, None] & in_rows[None, :])
