"""Packed FP4 and FP8 storage of the compressed KV entries and index keys (torch reference).

V4.1 stores its compressed KV entries already rounded to FP4 (E2M1 values, one float8_e4m3fn scale per
16) and its index keys to FP4 with a power-of-two scale per 32 (kernels/fake_quant.py). Keeping them
as the model's bf16 numbers spends 16 bits on a 4-bit value; packed, a 512-wide entry takes 256 bytes
of codes + 32 scale bytes instead of 1024, and nothing is lost: `unpack(pack(x))` is bitwise the
model's own `fake_quant(x)`, because both take their values and scales from the same helpers.

Pack where the values are made, not later from the cache: index keys re-pack from their rounded
values to the same values (power-of-two scales), but a rounded KV entry does not always re-pack to
itself (its new e4m3 scale comes from the rounded amax; in tests 19 of 13,120 values moved), so the
host tier must keep the bytes `pack_fp4_e4m3` made from the compressor's output.

Layout (as MXFP4 experts, kernels/quant.py): two E2M1 codes per byte, the even element in the low
nibble, codes 0-7 the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives; scales
as float8_e4m3fn bytes (`e4m3`) or as E8M0 exponents with bias 127 (`ue8m0`).

FP8 (`memory.kv_cache_dtype: fp8`, vLLM's fp8 / fp8_ds_mla): the first dim - tail channels as
float8_e4m3fn values with one float32 scale per 64 channels (scale = the block's amax / 448, values
rounded to the nearest e4m3, ties to even; a last block narrower than 64 takes the amax of what it
has), the last `tail` channels (the RoPE part of a compressed KV entry, as fp8_ds_mla keeps it) as
bfloat16. Lossy: a value moves by at most max(2^-4 of itself, 2^-10 of its block's scale) (e4m3's
3 mantissa bits; the second term in e4m3's subnormals, below 2^-6 * scale), a tail value by at most
2^-8 of itself. Every part is stored as bytes (e4m3 codes, the scales' float32 bytes, the tail's
bfloat16 bytes), so each gathers as uint8 rows like the FP4 codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fake_quant import FP8_MAX, fp4_e4m3_parts, fp4_ue8m0_parts
from kernels.quant import E2M1_VALUES

try:
    import triton
    import triton.language as tl

    from kernels.quant import _e4m3_to_float, _e8m0_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

_MAGNITUDES = E2M1_VALUES[:8]


@dataclass(frozen=True)
class PackedFP4:
    codes: torch.Tensor  # uint8 [..., dim / 2]
    scales: torch.Tensor  # uint8 [..., dim / block]: e4m3 bytes or E8M0 exponents
    block: int
    scale_format: str  # "e4m3" | "ue8m0"

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The byte tensors in storage order (models/packed_pages.py keeps one page tensor per part)."""
        return (self.codes, self.scales)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block or x.shape[-1] % 2:
        raise ValueError(f"the last dim {x.shape[-1]} is not a multiple of the {block}-wide scale block")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


_ON_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _grids(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 8 magnitudes, the 16 code values) on the device, copied once: a copy per call would sync
    and could not be captured in a CUDA graph."""
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = (_MAGNITUDES.to(device), E2M1_VALUES.to(device))
    return _ON_DEVICE[device]


def _codes(q: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """E2M1 values (exactly on the grid) -> packed code bytes [..., dim / 2]."""
    index = (q.abs().unsqueeze(-1) == _grids(q.device)[0]).int().argmax(dim=-1)
    codes = (index + 8 * (q < 0).int()).reshape(shape).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def pack_fp4_e4m3(x: torch.Tensor, block: int = 16) -> PackedFP4:
    """Compressed KV entries [..., dim] -> codes and e4m3 scales (what fake_quant_fp4_e4m3 rounds to)."""
    q, scale = fp4_e4m3_parts(_blocks(x, block))
    scales = scale.squeeze(-1).to(torch.float8_e4m3fn).view(torch.uint8)
    return PackedFP4(_codes(q, x.shape), scales, block, "e4m3")


def pack_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> PackedFP4:
    """Index keys [..., dim] -> codes and power-of-two scales (what fake_quant_fp4_ue8m0 rounds to)."""
    q, scale = fp4_ue8m0_parts(_blocks(x, block))
    exponents = (torch.frexp(scale.squeeze(-1))[1] - 1 + 127).to(torch.uint8)  # scale = 2 ** (e - 127)
    return PackedFP4(_codes(q, x.shape), exponents, block, "ue8m0")


def unpack_fp4(packed: PackedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., dim] in `dtype` (exact in float32 and bfloat16: at most 5 significant bits):
    one Triton kernel on the GPU, `unpack_fp4_reference` elsewhere."""
    if triton is None or not packed.codes.is_cuda:
        return unpack_fp4_reference(packed, dtype)
    return unpack_fp4_triton(packed, dtype)


def unpack_fp4_triton(packed: PackedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    half = packed.codes.shape[-1]
    codes = packed.codes.reshape(-1, half).contiguous()
    scales = packed.scales.reshape(-1, packed.scales.shape[-1]).contiguous()
    out = torch.empty(codes.shape[0], 2 * half, dtype=dtype, device=codes.device)
    if codes.shape[0]:
        _unpack_kernel[(codes.shape[0],)](
            codes, scales, _grids(codes.device)[1], out, half, scales.shape[-1], packed.block,
            packed.scale_format == "e4m3", HALF=triton.next_power_of_2(half),
        )
    return out.view(*packed.codes.shape[:-1], 2 * half)


def unpack_fp4_reference(packed: PackedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    low, high = (packed.codes & 0x0F).long(), (packed.codes >> 4).long()
    values = _grids(packed.codes.device)[1][torch.stack((low, high), dim=-1).flatten(-2)]
    if packed.scale_format == "e4m3":
        scales = packed.scales.view(torch.float8_e4m3fn).float()
    else:
        scales = torch.exp2(packed.scales.float() - 127)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // packed.block, packed.block) * scales.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)


FP8_BLOCK = 64


@dataclass(frozen=True)
class PackedFP8:
    codes: torch.Tensor  # uint8 [..., dim - tail]: float8_e4m3fn bytes
    scales: torch.Tensor  # uint8 [..., 4 * ceil((dim - tail) / block)]: one float32 scale per block, as bytes
    tail: torch.Tensor | None  # uint8 [..., 2 * tail]: the last channels' bfloat16 bytes (None: no tail)
    block: int

    def nbytes(self) -> int:
        return sum(part.numel() for part in self.parts())

    def parts(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.tail is None else (self.codes, self.scales, self.tail)


def fp8_widths(dim: int, tail: int = 0, block: int = FP8_BLOCK) -> tuple[int, ...]:
    """Bytes per entry of each part of a `dim`-wide entry: codes, scales (and the tail if any)."""
    if not 0 <= tail < dim:
        raise ValueError(f"an fp8 entry needs e4m3 channels: tail {tail} of a {dim}-wide entry")
    body = dim - tail
    widths = (body, 4 * -(-body // block))
    return widths + ((2 * tail,) if tail else ())


def _fp8_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [..., body] -> [..., ceil(body / block), block], the last block padded with zeros."""
    body = values.shape[-1]
    n = -(-body // block)
    return F.pad(values, (0, n * block - body)).reshape(*values.shape[:-1], n, block)


def pack_fp8(x: torch.Tensor, tail: int = 0, block: int = FP8_BLOCK) -> PackedFP8:
    """Entries [..., dim] -> e4m3 codes of the first dim - tail channels with a float32 scale (amax / 448)
    per `block` of them, and the last `tail` channels as bfloat16. Fixed-shape torch ops only."""
    fp8_widths(x.shape[-1], tail, block)
    body = x.shape[-1] - tail
    blocks = _fp8_blocks(x[..., :body].float(), block)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MAX * 2.0**-126)  # scales stay normal floats
    scale = amax / FP8_MAX
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = q.flatten(-2)[..., :body].contiguous().view(torch.uint8)
    scales = scale.squeeze(-1).contiguous().view(torch.uint8)
    rope = x[..., body:].to(torch.bfloat16).contiguous().view(torch.uint8) if tail else None
    return PackedFP8(codes, scales, rope, block)


def unpack_fp8(packed: PackedFP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., dim] in `dtype`: codes times their block's scale in float32, then the tail."""
    body = packed.codes.shape[-1]
    values = packed.codes.view(torch.float8_e4m3fn).float()
    scales = packed.scales.contiguous().view(torch.float32)
    out = (_fp8_blocks(values, packed.block) * scales.unsqueeze(-1)).flatten(-2)[..., :body].to(dtype)
    if packed.tail is None:
        return out
    return torch.cat([out, packed.tail.contiguous().view(torch.bfloat16).to(dtype)], dim=-1)


def fake_quant_fp8(x: torch.Tensor, tail: int = 0, block: int = FP8_BLOCK) -> torch.Tensor:
    """unpack_fp8(pack_fp8(x)) in x's dtype: what an fp8 cache reads back for x."""
    return unpack_fp8(pack_fp8(x, tail, block), x.dtype)


if triton is not None:

    @triton.jit
    def _unpack_kernel(codes_ptr, scales_ptr, values_ptr, out_ptr, half, n_scales, block, E4M3: tl.constexpr,
                       HALF: tl.constexpr):
        """One row: byte j holds elements 2j (low nibble) and 2j + 1 (high); each element times its
        block's scale (float8_e4m3fn bits decoded here, or 2 ** (exponent - 127))."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALF)
        inside = j < half
        byte = tl.load(codes_ptr + row * half + j, mask=inside, other=0).to(tl.int32)
        low = tl.load(values_ptr + (byte & 15), mask=inside, other=0.0)
        high = tl.load(values_ptr + (byte >> 4), mask=inside, other=0.0)
        low_scale = tl.load(scales_ptr + row * n_scales + (2 * j) // block, mask=inside, other=0).to(tl.int32)
        high_scale = tl.load(scales_ptr + row * n_scales + (2 * j + 1) // block, mask=inside, other=0).to(tl.int32)
        if E4M3:
            low_factor = _e4m3_to_float(low_scale)
            high_factor = _e4m3_to_float(high_scale)
        else:
            low_factor = _e8m0_to_float(low_scale)
            high_factor = _e8m0_to_float(high_scale)
        out_row = out_ptr + row * 2 * half
        tl.store(out_row + 2 * j, (low * low_factor).to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(out_row + 2 * j + 1, (high * high_factor).to(out_ptr.dtype.element_ty), mask=inside)
