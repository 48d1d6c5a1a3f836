"""Packed FP4 storage of V4.1's compressed KV entries and index keys (torch reference).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fake_quant import fp4_e4m3_parts, fp4_ue8m0_parts
from kernels.quant import E2M1_VALUES

_MAGNITUDES = E2M1_VALUES[:8]


@dataclass(frozen=True)
class PackedFP4:
    codes: torch.Tensor  # uint8 [..., dim / 2]
    scales: torch.Tensor  # uint8 [..., dim / block]: e4m3 bytes or E8M0 exponents
    block: int
    scale_format: str  # "e4m3" | "ue8m0"

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()


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
    """The values [..., dim] in `dtype` (exact in float32 and bfloat16: at most 5 significant bits)."""
    low, high = (packed.codes & 0x0F).long(), (packed.codes >> 4).long()
    values = _grids(packed.codes.device)[1][torch.stack((low, high), dim=-1).flatten(-2)]
    if packed.scale_format == "e4m3":
        scales = packed.scales.view(torch.float8_e4m3fn).float()
    else:
        scales = torch.exp2(packed.scales.float() - 127)
    blocks = values.reshape(*values.shape[:-1], -1, packed.block) * scales.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)
