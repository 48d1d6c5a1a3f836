"""Simulated (quantize, then dequantize) number formats that DeepSeek-V4.1 applies inside its forward.

V4.1 was trained quantization-aware: the cached window K=V, the compressed KV entries and the indexer's
q and k pass through these formats, so reproducing its outputs means rounding exactly as it does.
Each helper works on the last dim in blocks; when that dim is not a multiple of the block the reference
skips the quantizer, and so do these. Scales are computed in float32:
- fp8_ue8m0: float8_e4m3fn values, power-of-two (ue8m0) scale per 32 (window KV);
- fp4_ue8m0: E2M1 values, power-of-two scale per 32 (indexer q and k);
- fp4_e4m3: E2M1 values, float8_e4m3fn scale per 16 (compressed KV entries).

In torch each quantizer is ~15 kernels (abs, amax, clamp, frexp, ldexp, divide, bucketize, gathers, casts)
and a V4.1 decode step calls it for every layer's window row, compressed entry and index query / key:
on the tiny V4.1 ~100 of a step's 650 launches (BENCHMARKS.md, twenty-second session). On the GPU each
is one Triton kernel (`fake_quant_triton`) giving the same bits: the scales by exponent arithmetic on the
float32 bits (`pow2_ceil`'s frexp), the roundings to e4m3 and E2M1 by adding and subtracting a power of
two whose ulp is the target's quantum (the float32 adder rounds half to even, as torch's e4m3 cast and
the E2M1 thresholds do), e4m3 results saturating at 448 as the reference's clamp does (only an fp4_e4m3
block whose amax passes 2,688 reaches it).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

FP8_MAX = 448.0
FP4_MAX = 6.0
# the smallest amax each format's scale is taken from (the torch ops' clamp_min and the kernel's FLOOR)
FP8_UE8M0_FLOOR = 1e-4
FP4_UE8M0_FLOOR = FP4_MAX * 2.0**-126
FP4_E4M3_FLOOR = FP4_MAX * 2.0**-9
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_thresholds() -> torch.Tensor:
    """Round-half-to-even on the E2M1 grid: ties at .25/1.25/2.5/5 go down, at .75/1.75/3.5 go up."""
    up = torch.tensor(float("inf"))
    return torch.tensor([
        torch.nextafter(torch.tensor(0.25), up).item(), 0.75,
        torch.nextafter(torch.tensor(1.25), up).item(), 1.75,
        torch.nextafter(torch.tensor(2.5), up).item(), 3.5,
        torch.nextafter(torch.tensor(5.0), up).item(),
    ], dtype=torch.float32)


_THRESHOLDS = _e2m1_thresholds()


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(y)) for positive float32 y, exact at powers of two (log2 rounding would not be)."""
    mantissa, exponent = torch.frexp(y)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(y), exponent)


_ON_DEVICE: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _grid(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(thresholds, magnitudes) on the device, copied once: a copy per call would sync and could not
    be captured in a CUDA graph."""
    key = (device, dtype)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (_THRESHOLDS.to(device), torch.tensor(_E2M1_MAGNITUDES, dtype=dtype, device=device))
    return _ON_DEVICE[key]


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of q (|q| <= 6 expected); -0 comes back as +0."""
    thresholds, magnitudes = _grid(q.device, q.dtype)
    codes = torch.bucketize(q.abs(), thresholds, right=True)
    magnitude = magnitudes[codes]
    return torch.where(torch.signbit(q) & (magnitude > 0), -magnitude, magnitude)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


FP8_UE8M0, FP4_UE8M0, FP4_E4M3 = 0, 1, 2  # the kernel's FORMAT
# per FORMAT: (the clamp of the scaled values, the amax floor)
_FORMAT_LIMITS = {FP8_UE8M0: (FP8_MAX, FP8_UE8M0_FLOOR), FP4_UE8M0: (FP4_MAX, FP4_UE8M0_FLOOR),
                  FP4_E4M3: (FP4_MAX, FP4_E4M3_FLOOR)}


def _fused(x: torch.Tensor, block: int) -> bool:
    """The kernel runs it: CUDA, whole blocks, nothing autograd tracks (training keeps the torch ops)."""
    return (triton is not None and x.is_cuda and x.numel() > 0 and x.shape[-1] % block == 0
            and not (x.requires_grad and torch.is_grad_enabled()))


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    if _fused(x, block):
        return fake_quant_triton(x, block, FP8_UE8M0)
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_UE8M0_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_ue8m0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values, power-of-two scales [..., 1]) of float32 blocks [..., n, block]; shared with the
    packer (kernels/kv_pack.py), so packed and simulated values are the same numbers."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_UE8M0_FLOOR)
    scale = pow2_ceil(amax * torch.tensor(1 / FP4_MAX, dtype=torch.float32))
    return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)), scale


def fp4_e4m3_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values, float8_e4m3fn-valued float32 scales [..., 1]) of float32 blocks [..., n, block]."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_E4M3_FLOOR)
    # saturated at 448 explicitly: torch's own cast does so on the CPU from 2.13 and on CUDA, but older
    # CPU builds turn 480 and above into NaN (the H200 image's torch 2.11 did, failing the kernel's test)
    scale = (amax / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()
    return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)), scale


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    if _fused(x, block):
        return fake_quant_triton(x, block, FP4_UE8M0)
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    q, scale = fp4_ue8m0_parts(blocks)
    return (q * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    if _fused(x, block):
        return fake_quant_triton(x, block, FP4_E4M3)
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    q, scale = fp4_e4m3_parts(blocks)
    return (q * scale).reshape(x.shape).to(x.dtype)


BLOCKS_PER_PROGRAM = 32  # quantization blocks a program of the kernel rounds


def fake_quant_triton(x: torch.Tensor, block: int, fmt: int) -> torch.Tensor:
    """One of the three quantizers (FORMAT FP8_UE8M0 / FP4_UE8M0 / FP4_E4M3) over x's last dim in blocks
    of `block` (a power of two dividing it), the reference's bits; x in any float dtype, out in x's."""
    rows = x.contiguous().view(-1, block)
    out = torch.empty_like(rows)
    n = rows.shape[0]
    if n:
        top, floor = _FORMAT_LIMITS[fmt]
        _fake_quant_kernel[(triton.cdiv(n, BLOCKS_PER_PROGRAM),)](
            rows, out, n, FORMAT=fmt, TOP=top, FLOOR=floor, BLOCK=block, ROWS=BLOCKS_PER_PROGRAM, num_warps=4)
    return out.view(x.shape)


if triton is not None:
    _E4M3_MAX = tl.constexpr(FP8_MAX)  # a jit function reads only constexpr globals

    @triton.jit
    def _pow2_ceil(y):
        """`pow2_ceil` on positive normal float32: y's exponent, one more unless y is a power of two."""
        bits = y.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
        return (exponent << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_to_quantum(magnitude, magic_exponent):
        """magnitude rounded half to even to a multiple of 2 ** (magic_exponent - 127 - 23): added to and
        taken from 2 ** (magic_exponent - 127), whose ulp that is (float32 adds round half to even)."""
        magic = (magic_exponent << 23).to(tl.float32, bitcast=True)
        return (magnitude + magic) - magic

    @triton.jit
    def _e4m3(v):
        """float32 -> float8_e4m3fn -> float32 as torch's CPU cast: round half to even to 3 mantissa bits
        (2 ** -9 steps below 2 ** -6), saturating at 448, the sign kept (-0 too)."""
        bits = v.to(tl.int32, bitcast=True)
        magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        # normal: the ulp of 2 ** (e + 20) is e's quantum 2 ** (e - 3); below 2 ** -6 a fixed 2 ** -9 (2 ** 14's ulp)
        rounded = _round_to_quantum(magnitude, tl.where(exponent < 121, 141, exponent + 20))
        rounded = tl.minimum(rounded, _E4M3_MAX)
        return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1(v):
        """`round_e2m1` for |v| <= 6: steps of 0.5 below 2, 1 below 4, 2 up to 6, half to even; a value
        rounding to 0 comes back +0."""
        magnitude = tl.abs(v)
        rounded = _round_to_quantum(magnitude, tl.where(magnitude < 2.0, 149, tl.where(magnitude < 4.0, 150, 151)))
        return tl.where((v < 0) & (rounded > 0), -rounded, rounded)

    @triton.jit
    def _fake_quant_kernel(x_ptr, out_ptr, n, FORMAT: tl.constexpr, TOP: tl.constexpr, FLOOR: tl.constexpr,
                           BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """Blocks [program x ROWS, + ROWS) of x [n, BLOCK]: amax, scale, divide, clamp, round, times the
        scale, cast back: the reference's float32 operations in its order. The divisions are IEEE
        round-to-nearest (`div_rn`): Triton's `/` on float32 compiles to the approximate `div.full.f32`
        (up to 2 ulp off), exact only by a power of two, so fp4_e4m3's e4m3 scale rounded differently
        from torch on the GPU (the interpreter divides exactly and could not show it)."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = (row < n)[:, None]
        offsets = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + offsets, mask=live, other=0.0)
        blocks = x.to(tl.float32)
        amax = tl.max(tl.abs(blocks), axis=1)
        amax = tl.where(amax < FLOOR, FLOOR, amax)
        if FORMAT == 2:  # fp4_e4m3: an e4m3 scale
            scale = _e4m3(tl.math.div_rn(amax, TOP))
        else:  # a power of two
            scale = _pow2_ceil(amax * (1.0 / TOP))
        v = tl.math.div_rn(blocks, scale[:, None])
        v = tl.minimum(tl.maximum(v, -TOP), TOP)
        if FORMAT == 0:
            q = _e4m3(v)
        else:
            q = _e2m1(v)
        tl.store(out_ptr + offsets, (q * scale[:, None]).to(x.dtype), mask=live)
