"""Block-scaled number formats of the DeepSeek-V4 checkpoints (torch references).

- FP8 weights: float8_e4m3fn values with one scale per 128x128 block (`weight_scale_inv` in HF's
  fine-grained FP8 format, `scale` in the original release), real = value * scale.
- MXFP4 experts: E2M1 values packed two per byte (low nibble = even index) with one power-of-two
  E8M0 scale per 32 values along the input dim.
The quantizers exist for building test checkpoints; serving only dequantizes. The Triton helpers at
the end decode single values of these formats from their bits inside kernels (`tl.exp2` is approximate
on the GPU, and lookup tables cost a gather per value).
"""

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run
    triton = None

FP8_BLOCK = 128
MXFP4_BLOCK = 32  # also the E8M0 scale block of Engram rows
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _as_float_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales may arrive as float8_e8m0fnu or as raw uint8 exponents (bias 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127)
    return scale.to(torch.float32)


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """[out, in] fp8 values and [ceil(out/block), ceil(in/block)] scales -> float32 [out, in]."""
    out_dim, in_dim = weight.shape[-2:]
    scale = _as_float_scales(scale)
    expanded = scale.repeat_interleave(block, dim=-2)[..., :out_dim, :]
    expanded = expanded.repeat_interleave(block, dim=-1)[..., :in_dim]
    return weight.to(torch.float32) * expanded


def quantize_fp8_blocks(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of dequantize_fp8_blocks: per-block amax / 448 scales."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(rows, block, cols, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    values = (blocks / scale[:, None, :, None]).view(rows * block, cols * block)[:out_dim, :in_dim]
    return values.to(torch.float8_e4m3fn), scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """[..., in/2] packed bytes and [..., in/block] E8M0 scales -> float32 [..., in]."""
    raw = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    low, high = (raw & 0x0F).long(), (raw >> 4).long()
    codes = torch.stack((low, high), dim=-1).flatten(-2)
    values = E2M1_VALUES.to(raw.device)[codes]
    return values * _as_float_scales(scale).repeat_interleave(block, dim=-1)


@dataclass(frozen=True)
class MXFP4Experts:
    """One projection of every held expert as released: codes uint8 [E, rows, cols / 2] (low nibble =
    even column), scales uint8 E8M0 exponents [E, rows, cols / 32]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        held, rows, half = self.codes.shape
        return torch.Size((held, rows, 2 * half))

    def expert(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s matrix [rows, cols] in `dtype` (exact: an E2M1 value times a power of two)."""
        return dequantize_mxfp4(self.codes[local], self.scales[local]).to(dtype)


def quantize_mxfp4(weight: torch.Tensor, block: int = MXFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest E2M1 with a power-of-two scale per block; returns (packed uint8, uint8 exponents)."""
    w = weight.float()
    blocks = w.view(*w.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitudes = E2M1_VALUES[:8].to(w.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = codes + 8 * (scaled < 0).long() * (codes > 0).long()
    codes = codes.view(*w.shape[:-1], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


if triton is not None:

    @triton.jit
    def _e4m3_to_float(bits):
        """float8_e4m3fn bits -> float32, from the bit pattern (any GPU, and Triton's interpreter): sign,
        4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (mantissa x 2 ** -9), 0x7F NaN."""
        sign, exponent, mantissa = (bits >> 7) & 1, (bits >> 3) & 15, bits & 7
        normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))
        value = tl.where(exponent == 0, subnormal, normal)
        return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)

    @triton.jit
    def _e8m0_to_float(exponent):
        """E8M0 exponents (int32) -> 2 ** (exponent - 127) as float32, from the bits (0: the subnormal 2 ** -127)."""
        return tl.where(exponent == 0, 1 << 22, exponent << 23).to(tl.float32, bitcast=True)
