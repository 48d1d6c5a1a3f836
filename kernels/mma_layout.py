"""MXFP4 experts laid out for `mma.sync`: each warp lane's 16-byte load is its tensor-core operand.

Released MXFP4 codes are [E, rows, cols / 2], two E2M1 codes a byte (low nibble = even column), with
an E8M0 scale per 32 columns. The CUDA decode kernel (kernels/moe_mxfp4_mma.py) multiplies them with
`mma.m16n8k16`, whose B operand gives lane (g, t) of a warp row g's columns 2t, 2t + 1, 2t + 8, 2t + 9
of each 16-column k-block. Laid out once at load (`mma_layout`), per 8-row x 128-column tile, lane
(g, t)'s 16 bytes are exactly those codes for row g and the tile's four 32-column groups (one scale
each), so the kernel decodes registers as loaded, with no shuffle through shared memory. The Triton
kernels (kernels/moe_mxfp4.py) read this layout too, for prefill. Pure torch: the conversion runs
wherever the weights are, in their own storage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.quant import dequantize_mxfp4

TILE_ROWS = 8  # rows of one mma tile (the B operand's n)
CHUNK = 128  # columns of one load: 4 scale groups of 32
# nibble j of byte b of lane t's 32-bit word in a 32-code group: the code at LOW[t][b] (j = 0) or
# LOW[t][b] + 8 (j = 1). Bytes 0, 1 hold k-block 0's B operand (k = 2t, 2t + 1 | 2t + 8, 2t + 9),
# bytes 2, 3 k-block 1's; the PTX decode takes the low nibbles of bytes (0, 1) to one bf16x2 register
# and their high nibbles to another: b0 and b1 of mma.m16n8k16 for k-block 0.
LOW = torch.tensor([[2 * t, 2 * t + 1, 16 + 2 * t, 17 + 2 * t] for t in range(4)])


# activation column read at position p of a 128-column chunk by the Triton kernels on this layout
# (kernels/moe_mxfp4.py): they take a row's 64 stored bytes in order, byte j = 16 t + 4 group + b
# giving positions 2j (low nibble) and 2j + 1 (high), so position p holds column 32 group + LOW[t][b]
# (+ 8 for the high nibble)
_BYTE = torch.arange(64)
CODE_ORDER = torch.stack((32 * ((_BYTE // 4) % 4) + LOW[_BYTE // 16, _BYTE % 4],) * 2, -1).flatten()
CODE_ORDER[1::2] += 8


def in_code_order(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, cols] (contiguous) with each 128-column chunk's columns in CODE_ORDER (a new tensor)."""
    tokens, cols = x.shape
    return x.view(tokens, cols // CHUNK, CHUNK)[:, :, _code_order(x.device)].reshape(tokens, cols)


@functools.cache
def _code_order(device: torch.device) -> torch.Tensor:
    """CODE_ORDER on `device`, copied once (a copy from host memory cannot be captured in a CUDA graph)."""
    return CODE_ORDER.to(device)


@dataclass(frozen=True)
class MXFP4MMAExperts:
    """One projection of every held expert in `mma_layout`: codes uint8 [E, rows / 8, cols / 128, 8, 64],
    scales uint8 E8M0 [E, rows, cols / 32] as released."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        held, tiles, chunks, _, _ = self.codes.shape
        return torch.Size((held, tiles * TILE_ROWS, chunks * CHUNK))

    def expert(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s matrix [rows, cols] in `dtype` (the reference loop's view of it)."""
        return dequantize_mxfp4(released_layout(self.codes[local : local + 1])[0], self.scales[local]).to(dtype)


def mma_layout(codes: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Released codes [E, rows, cols / 2] (low nibble = even column) -> [E, rows / 8, cols / 128, 8, 64]:
    per 8-row x 128-column tile, row g's 64 bytes as 4 lanes (t) x 4 groups x 4 bytes, byte b of lane t
    holding codes LOW[t][b] (low nibble) and LOW[t][b] + 8 (high) of the group. Expert by expert,
    each written over its own bytes (the result has the input's size): `in_place` converts a loaded
    layer in its own storage (a view of `codes` comes back), with no second copy of the layer."""
    held, rows, half = codes.shape
    cols = 2 * half
    if rows % TILE_ROWS or cols % CHUNK:
        raise ValueError(f"mma_layout needs rows % {TILE_ROWS} == 0 and cols % {CHUNK} == 0, got {rows} x {cols}")
    if not codes.is_contiguous():
        raise ValueError("mma_layout needs contiguous codes")
    out = (codes if in_place else torch.empty_like(codes)).view(held, rows // TILE_ROWS, cols // CHUNK, TILE_ROWS, 64)
    low = LOW.to(codes.device)
    for expert in range(held):
        packed = codes[expert]
        nibbles = torch.stack((packed & 15, packed >> 4), -1)  # [rows, half, 2]: column order
        groups = nibbles.reshape(rows // TILE_ROWS, TILE_ROWS, cols // CHUNK, 4, 32)  # [tile, g, chunk, group, code]
        words = groups[..., low] | (groups[..., low + 8] << 4)  # [tile, g, chunk, group, t, byte]
        out[expert] = words.permute(0, 2, 1, 4, 3, 5).reshape(rows // TILE_ROWS, cols // CHUNK, TILE_ROWS, 64)
    return out


def released_layout(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of `mma_layout` (a new tensor): the released codes [E, rows, cols / 2]."""
    held, tiles, chunks, _, _ = tiled.shape
    words = tiled.reshape(held, tiles, chunks, TILE_ROWS, 4, 4, 4).permute(0, 1, 3, 2, 5, 4, 6)  # [E, tile, g, chunk, group, t, byte]
    groups = torch.empty(*words.shape[:5], 32, dtype=torch.uint8, device=tiled.device)
    low = LOW.to(tiled.device)
    groups[..., low] = words & 15
    groups[..., low + 8] = words >> 4
    codes = groups.reshape(held, tiles * TILE_ROWS, chunks * CHUNK // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4)


def from_released(codes: torch.Tensor, scales: torch.Tensor) -> MXFP4MMAExperts:
    """A laid-out copy of released MXFP4 experts (the released tensors are left as they are)."""
    return MXFP4MMAExperts(mma_layout(codes), scales.contiguous())


