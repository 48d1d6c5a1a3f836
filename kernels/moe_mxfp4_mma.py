"""MXFP4 routed experts for decode in CUDA C++: weights laid out at load (kernels/mma_layout.py) so that
each lane's 16-byte load is its tensor-core operand, decoded in registers and multiplied by
`mma.sync`, with no trip through shared memory.

Why not Triton (kernels/moe_mxfp4.py): at decode an expert sees one or two tokens, so the kernels are
a stream of weights through a decode. ncu on the H200 (BENCHMARKS.md, seventeenth session) shows the
Triton decode kernels issue-bound at 255 registers a thread (2 programs of 4 warps an SM): Triton
decodes a weight tile in a blocked layout and converts it into the MMA operand layout, which costs
more instructions than the decode itself, and capping the registers spills. Here that conversion is
done once, at load, and the decode is kernels/moe_mxfp4.py's PTX (exact: the reference's bf16 bits),
whose output registers are the operand registers as they stand. The layout gives each lane one scale
group of a chunk, so one scale and one 16-byte load of codes a tile, and its activations as 16-byte
loads; where every scale exponent of a matrix is at most 128 (any real checkpoint: scales up to 2),
the decode's bias and the scale are one multiplier (`scaled` in the device code): ~10% faster at 8-64 tokens
(BENCHMARKS.md, eighteenth session), the same bits.

One CTA of 4 warps owns one block of up to 16 pairs routed to one expert (found by scanning the step's
expert ids, as the Triton decode kernels do: no sort, no host sync, capturable) x 32 x `tiles` output
rows x one K share; each lane keeps the next 128-column chunk's weights, scales and activation
operands in flight in registers while it decodes and multiplies the current one. (Staging the weights
through shared memory by cp.async instead measured slower at every batch: BENCHMARKS.md.) It writes
float32 partial sums [shares, pairs, rows], which kernels/moe_pairs.py's `swiglu_pairs`
(gate_up) and kernels/moe_pairs.py's `sum_pairs` (down) finish. Prefill (more than MAX_SCAN_PAIRS
pairs) runs kernels/moe_mxfp4.py's sorted kernels, which read this layout too.

Compiled at first use by NVRTC through CuPy (the `gpu` extra). Needs sm_90 (`mul.rn.bf16x2`) and
rows and columns in multiples of the CTA's rows and of 128 (`supported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cuda_mma import compiled, device_index, launch, multiprocessors, runs_on
from kernels.mma_layout import CHUNK, TILE_ROWS, MXFP4MMAExperts
from kernels.moe_mxfp4 import MAX_SCAN_PAIRS
from kernels.moe_pairs import pair_table, sum_pairs, swiglu_pairs_triton

@dataclass(frozen=True)
class Build:
    """The kernel's compile-time shape: `tiles` mma tiles of 8 rows a warp (a CTA of 4 warps owns
    32 x tiles rows) and `min_blocks` CTAs an SM its register allocation must allow. The default is
    the fastest of the seventeenth session's sweep (BENCHMARKS.md)."""

    tiles: int = 8
    min_blocks: int = 2

    @property
    def block_rows(self) -> int:
        return 4 * TILE_ROWS * self.tiles


BUILD = Build()


def supported(device: torch.device, rows: int, cols: int) -> bool:
    """Whether the kernel runs here (kernels/cuda_mma.py's `runs_on`) for matrices of `rows` x `cols`:
    rows a multiple of the CTA's rows and cols of CHUNK."""
    return not rows % BUILD.block_rows and not cols % CHUNK and runs_on(device)


def experts_mma(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: MXFP4MMAExperts, down: MXFP4MMAExperts,
    first: int, limit: float, weight_before_down: bool, residual: torch.Tensor | None = None, *,
    shares: tuple[int, int] | None = None, build: Build = BUILD,
) -> torch.Tensor:
    """`experts_reference`'s contract (kernels/moe.py) for bf16 x [T, dim] on CUDA, at most
    MAX_SCAN_PAIRS (token, expert) pairs. `shares`: K shares of (gate_up, down); None: enough CTAs to
    keep ~4 an SM busy."""
    tokens, k = experts.shape
    pairs = tokens * k
    if pairs > MAX_SCAN_PAIRS:
        raise ValueError(f"{pairs} (token, expert) pairs: the decode kernel takes at most {MAX_SCAN_PAIRS}")
    held, double_inter, dim = gate_up.shape
    inter = double_inter // 2
    if double_inter % build.block_rows or dim % build.block_rows or inter % CHUNK:
        raise ValueError(f"experts of {dim} x {inter}: the mma kernel takes rows in multiples of "
                         f"{build.block_rows} and columns in multiples of {CHUNK}")
    expert_of, weight = pair_table(experts, weights, first, held)
    wanted = shares or (_fill(pairs, held, double_inter, dim, build), _fill(pairs, held, dim, inter, build))
    partial = _gemm(x.contiguous(), expert_of, gate_up, k, wanted[0], build)
    hidden = swiglu_pairs_triton(partial, expert_of, weight, limit, weight_before_down)
    out = _gemm(hidden, expert_of, down, 1, wanted[1], build)
    return sum_pairs(out, expert_of, weight, k, weight_before_down, residual)


# K chunks a share takes at least: fewer leave too little streaming to pay for a CTA's scan and its
# first loads in flight (one V4-Flash layer on the H200, eighteenth session: at one token 4 gate_up and
# 2 down shares of 8 chunks took 50.2 us against 52.2 for 6 shares of 5 and 3)
MIN_SHARE_CHUNKS = 8


def _fill(pairs: int, held: int, rows: int, cols: int, build: Build) -> int:
    """K shares so that the CTAs that work (one per expert with a pair, per block of rows) are ~4 an SM,
    each share at least MIN_SHARE_CHUNKS chunks."""
    working = min(pairs, held) * (rows // build.block_rows)
    return max(1, min(cols // CHUNK // MIN_SHARE_CHUNKS, -(-4 * multiprocessors(torch.cuda.current_device()) // working)))


def _gemm(act: torch.Tensor, expert_of: torch.Tensor, w: MXFP4MMAExperts, div: int, shares: int,
          build: Build) -> torch.Tensor:
    """float32 [shares, pairs, rows]: pair p's row of act[p // div] times its expert's matrix, K in shares
    (rows of other ranks' pairs are left unwritten)."""
    if act.dtype != torch.bfloat16:
        raise ValueError(f"the MXFP4 mma experts take bf16 activations, got {act.dtype}")
    if act.data_ptr() % 16:
        raise ValueError("the MXFP4 mma experts read activations 16 bytes at a time: their rows must be 16-byte aligned")
    _, rows, cols = w.shape
    if rows % build.block_rows:
        raise ValueError(f"{rows} rows: the mma experts take multiples of {build.block_rows}")
    pairs = expert_of.numel()
    chunks = cols // CHUNK
    per = -(-chunks // max(1, min(shares, chunks)))
    shares = -(-chunks // per)
    out = torch.empty(shares, pairs, rows, dtype=torch.float32, device=act.device)
    device = device_index(act)
    # FUSED_SCALE: the weights' scales all fit the one-multiply decode (kernels/mma_layout.py)
    options = (f"-DTILES={build.tiles}", f"-DMIN_BLOCKS={build.min_blocks}", f"-DFUSED_SCALE={int(w.small_scales)}")
    launch(compiled(_SOURCE, "mxfp4_mma_gemm", options, device), (pairs, rows // build.block_rows, shares),
           (np.uint64(act.data_ptr()), np.uint64(expert_of.data_ptr()), np.uint64(w.codes.data_ptr()),
            np.uint64(w.scales.data_ptr()), np.uint64(out.data_ptr()), np.int32(pairs), np.int32(div),
            np.int32(rows), np.int32(cols), np.int32(per)), device)
    return out


_SOURCE = r"""
#ifndef FUSED_SCALE
#define FUSED_SCALE 0  // 1: every scale exponent of the matrix is <= 128 (see `scaled`)
#endif

// kernels/moe_mxfp4.py's exact PTX decode, as steps. `prmt` spreads a word's bytes 0, 1 (selector
// 0x4140) or 2, 3 (0x4342) into the 16-bit lanes; each lane's low nibble (`low_codes`) or high nibble
// (`high_codes`) becomes the bf16 bits of its E2M1 value x 2^-126 (sign to bit 15, magnitude to bits 8-6).
__device__ __forceinline__ unsigned spread(unsigned word, unsigned selector) {
    unsigned t;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(t) : "r"(word), "r"(selector));
    return t;
}

__device__ __forceinline__ unsigned low_codes(unsigned t) {
    unsigned u;
    asm("{\n"
        ".reg .b32 a, b;\n"
        "shl.b32 a, %1, 6;\n"
        "shl.b32 b, %1, 12;\n"
        "lop3.b32 %0, a, b, 0x81C081C0, 0xA8;\n"
        "}\n"
        : "=r"(u) : "r"(t));
    return u;
}

__device__ __forceinline__ unsigned high_codes(unsigned t) {
    unsigned u;
    asm("{\n"
        ".reg .b32 a;\n"
        "and.b32 a, %1, 0x00F000F0;\n"
        "mul.lo.u32 a, a, 0x104;\n"
        "and.b32 %0, a, 0x81C081C0;\n"
        "}\n"
        : "=r"(u) : "r"(t));
    return u;
}

__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// value x 2^-126 -> value x the E8M0 scale: x 2^126 (exact: the products are normal bf16s), then x the
// scale (`scale_pair`); or, when every scale is at most 2^1, x 2^(e - 1) at once (`fused_scale_pair`: a
// normal bf16 for e <= 128, and the product is still exact, an E2M1 value having 2 significant bits).
__device__ __forceinline__ unsigned scaled(unsigned u, unsigned scale) {
#if FUSED_SCALE
    return mul_bf16x2(u, scale);
#else
    return mul_bf16x2(mul_bf16x2(u, 0x7E807E80u), scale);
#endif
}

// 8 codes (one 32-bit word in mma_layout) -> the B operands of two k-blocks: r0 / r2 the low / high
// nibbles of bytes 0, 1 (b0 / b1 of the first), r1 / r3 those of bytes 2, 3.
__device__ __forceinline__ void decode8(unsigned word, unsigned scale, unsigned& r0, unsigned& r1,
                                        unsigned& r2, unsigned& r3) {
    const unsigned t0 = spread(word, 0x4140u), t1 = spread(word, 0x4342u);
    r0 = scaled(low_codes(t0), scale);
    r1 = scaled(low_codes(t1), scale);
    r2 = scaled(high_codes(t0), scale);
    r3 = scaled(high_codes(t1), scale);
}

// E8M0 e -> bf16 bits of 2^(e - 127) in both halves (e = 0: the subnormal 2^-127).
__device__ __forceinline__ unsigned scale_pair(unsigned e) {
    unsigned bits = max(e << 7, 0x40u);
    return bits | (bits << 16);
}

// E8M0 e <= 128 -> bf16 bits of 2^(e - 1) in both halves.
__device__ __forceinline__ unsigned fused_scale_pair(unsigned e) {
    unsigned bits = (e + 126u) << 7;
    return bits | (bits << 16);
}
#ifndef TILES
#define TILES 8  // mma tiles (8 rows each) a warp: a CTA owns 4 x 8 x TILES rows
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS)
mxfp4_mma_gemm(const uint4* __restrict__ act, const int* __restrict__ expert_of, const uint4* __restrict__ codes,
               const unsigned char* __restrict__ scales, float* __restrict__ out, int pairs, int div, int rows, int cols,
               int share_chunks) {
    __shared__ int group[16];
    __shared__ int warp_count[4];
    const int p = blockIdx.x;
    const int expert = expert_of[p];
    if (expert < 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // work only if p is the (16 j)-th pair routed to its expert, counted in pair order
    int before = 0;
    for (int q = tid; q < p; q += 128) before += expert_of[q] == expert;
    for (int o = 16; o; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
    if (lane == 0) warp_count[warp] = before;
    __syncthreads();
    const int rank = warp_count[0] + warp_count[1] + warp_count[2] + warp_count[3];
    if (rank & 15) return;
    __syncthreads();
    int found = 0;  // this expert's pairs from p on, in order, the first 16
    for (int start = p; start < pairs && found < 16; start += 128) {
        const int q = start + tid;
        const bool hit = q < pairs && expert_of[q] == expert;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        int slot = found + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) slot += warp_count[w];
        if (hit && slot < 16) group[slot] = q;
        found += warp_count[0] + warp_count[1] + warp_count[2] + warp_count[3];
        __syncthreads();
    }
    const int m = min(found, 16);
    const int g = lane >> 2, t = lane & 3;
    const int loads_per_row = cols >> 3;  // 16-byte loads: 8 bf16 each
    const uint4* row0 = g < m ? act + (size_t)(group[g] / div) * loads_per_row : nullptr;
    const uint4* row1 = g + 8 < m ? act + (size_t)(group[g + 8] / div) * loads_per_row : nullptr;
    const int chunks = cols >> 7;
    const int begin = blockIdx.z * share_chunks;
    const int end = min(begin + share_chunks, chunks);
    const int first_row = (blockIdx.y * 4 + warp) * 8 * TILES;
    const uint4* tile[TILES];
    const unsigned char* scale_row[TILES];  // lane t's: scale group t of each chunk
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
        const size_t tile_index = (size_t)expert * (rows >> 3) + (first_row >> 3) + j;
        tile[j] = codes + tile_index * chunks * 32 + g * 4 + t;
        scale_row[j] = scales + ((size_t)expert * rows + first_row + 8 * j + g) * (chunks * 4) + t;
    }
    float acc[TILES][4] = {};
    uint4 w_next[TILES];
    unsigned s_next[TILES];
    unsigned a[8][4];
    unsigned a_next[8][4];
    if (begin < end) {
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
            w_next[j] = __ldg(tile[j] + (size_t)begin * 32);
            s_next[j] = __ldg(scale_row[j] + begin * 4);
        }
        load_a(a_next, row0, row1, begin, t);
    }
    for (int c = begin; c < end; ++c) {
        uint4 w[TILES];
        unsigned s[TILES];
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
            w[j] = w_next[j];
            s[j] = s_next[j];
        }
#pragma unroll
        for (int kb = 0; kb < 8; ++kb)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[kb][i] = a_next[kb][i];
        if (c + 1 < end) {
#pragma unroll
            for (int j = 0; j < TILES; ++j) {
                w_next[j] = __ldg(tile[j] + (size_t)(c + 1) * 32);
                s_next[j] = __ldg(scale_row[j] + (c + 1) * 4);
            }
            load_a(a_next, row0, row1, c + 1, t);
        }
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
            const unsigned words[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#if FUSED_SCALE
            const unsigned scale = fused_scale_pair(s[j]);
#else
            const unsigned scale = scale_pair(s[j]);
#endif
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // word q: k-blocks 2q and 2q + 1
                unsigned r0, r1, r2, r3;
                decode8(words[q], scale, r0, r1, r2, r3);
                mma(acc[j], a[2 * q], r0, r2);
                mma(acc[j], a[2 * q + 1], r1, r3);
            }
        }
    }
    float* base = out + (size_t)blockIdx.z * pairs * rows;
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
        const int n = first_row + 8 * j + 2 * t;
        if (g < m) *reinterpret_cast<float2*>(base + (size_t)group[g] * rows + n) = make_float2(acc[j][0], acc[j][1]);
        if (g + 8 < m)
            *reinterpret_cast<float2*>(base + (size_t)group[g + 8] * rows + n) = make_float2(acc[j][2], acc[j][3]);
    }
}
"""
