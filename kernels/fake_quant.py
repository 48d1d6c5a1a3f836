"""Simulated (quantize, then dequantize) number formats that DeepSeek-V4.1 applies inside its forward.

V4.1 was trained quantization-aware: the cached window K=V, the compressed KV entries and the indexer's
q and k pass through these formats, so reproducing its outputs means rounding exactly as it does.
Each helper works on the last dim in blocks; when that dim is not a multiple of the block the reference
skips the quantizer, and so do these. Scales are computed in float32:
- fp8_ue8m0: float8_e4m3fn values, power-of-two (ue8m0) scale per 32 (window KV);
- fp4_ue8m0: E2M1 values, power-of-two scale per 32 (indexer q and k);
- fp4_e4m3: E2M1 values, float8_e4m3fn scale per 16 (compressed KV entries).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
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


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_ue8m0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values, power-of-two scales [..., 1]) of float32 blocks [..., n, block]; shared with the
    packer (kernels/kv_pack.py), so packed and simulated values are the same numbers."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax * torch.tensor(1 / FP4_MAX, dtype=torch.float32))
    return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)), scale


def fp4_e4m3_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values, float8_e4m3fn-valued float32 scales [..., 1]) of float32 blocks [..., n, block]."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-9)
    scale = (amax / FP4_MAX).to(torch.float8_e4m3fn).float()
    return round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)), scale


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    q, scale = fp4_ue8m0_parts(blocks)
    return (q * scale).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    q, scale = fp4_e4m3_parts(blocks)
    return (q * scale).reshape(x.shape).to(x.dtype)
