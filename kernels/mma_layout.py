"""MXFP4 experts laid out for `mma.sync`: each warp lane's 16-byte load is its tensor-core operand.

Released MXFP4 codes are [E, rows, cols / 2], two E2M1 codes a byte (low nibble = even column), with
an E8M0 scale per 32 columns. The CUDA decode kernel (kernels/moe_mxfp4_mma.py) multiplies them with
`mma.m16n8k16`, whose B operand gives lane (g, t) of a warp weight row g's k = 2t, 2t + 1 (register b0)
and 2t + 8, 2t + 9 (b1) of each 16-k block, and whose A operand the activations' same k. A product
sums over k, so which column a k stands for is free, as long as both operands agree: here k-block kb
of a 128-column chunk gives lane t columns 32 t + 4 kb + {0, 1} (b0) and + {2, 3} (b1). Then a lane's
weights for a chunk are one 32-column scale group (one 16-byte load, one scale) and its activations
one run of 32 columns (four 16-byte loads a row). Laid out once at load (`mma_layout`): per 8-row x
128-column tile, row g's 64 bytes are the released ones with the nibbles of each byte pair exchanged,
so byte 2i holds columns 4i, 4i + 2 (low, high nibble) and byte 2i + 1 columns 4i + 1, 4i + 3: the PTX
decode turns bytes (0, 1)'s low nibbles into b0 and their high nibbles into b1. The Triton kernels
(kernels/moe_mxfp4.py) read this layout too, for prefill, with the activations in CODE_ORDER. Pure
torch: the conversion runs wherever the weights are, in their own storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cuda_mma import CHUNK, TILE_ROWS
from kernels.quant import dequantize_mxfp4
# E8M0 exponents up to this give scales 2 ** (e - 127) <= 2, for which the decode's bias 2 ** 126 and
# the scale fold into one normal bf16 multiplier 2 ** (e - 1) (kernels/moe_mxfp4_mma.py)
SMALL_SCALE_EXPONENT = 128


@dataclass(frozen=True)
class MXFP4MMAExperts:
    """One projection of every held expert in `mma_layout`: codes uint8 [E, rows / 8, cols / 128, 8, 64],
    scales uint8 E8M0 [E, rows, cols / 32] as released. `small_scales`: every exponent is at most
    SMALL_SCALE_EXPONENT (checked once, at load: the kernel then decodes with one multiply fewer)."""

    codes: torch.Tensor
    scales: torch.Tensor
    small_scales: bool = False

    @property
    def shape(self) -> torch.Size:
        held, tiles, chunks, _, _ = self.codes.shape
        return torch.Size((held, tiles * TILE_ROWS, chunks * CHUNK))

    def expert(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s matrix [rows, cols] in `dtype` (the reference loop's view of it)."""
        return dequantize_mxfp4(released_layout(self.codes[local : local + 1])[0], self.scales[local]).to(dtype)


def small_scales(scales: torch.Tensor) -> bool:
    """Whether every E8M0 exponent is at most SMALL_SCALE_EXPONENT (one host sync: a load-time check)."""
    return scales.numel() == 0 or int(scales.max()) <= SMALL_SCALE_EXPONENT


def _exchange_nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] byte pairs (a, b) -> (a's low | b's low << 4, a's high | b's high << 4); its own inverse."""
    low, high = pairs & 15, pairs >> 4
    return torch.stack((low[..., 0] | (low[..., 1] << 4), high[..., 0] | (high[..., 1] << 4)), -1)


def mma_layout(codes: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Released codes [E, rows, cols / 2] -> [E, rows / 8, cols / 128, 8, 64]: per 8-row x 128-column
    tile, each row's 64 bytes with the nibbles of every byte pair exchanged. Expert by expert, each
    written over its own bytes (the result has the input's size): `in_place` converts a loaded layer in
    its own storage (a view of `codes` comes back), with no second copy of the layer."""
    held, rows, half = codes.shape
    cols = 2 * half
    if rows % TILE_ROWS or cols % CHUNK:
        raise ValueError(f"mma_layout needs rows % {TILE_ROWS} == 0 and cols % {CHUNK} == 0, got {rows} x {cols}")
    if not codes.is_contiguous():
        raise ValueError("mma_layout needs contiguous codes")
    tiles, chunks = rows // TILE_ROWS, cols // CHUNK
    out = (codes if in_place else torch.empty_like(codes)).view(held, tiles, chunks, TILE_ROWS, 64)
    for expert in range(held):
        pairs = codes[expert].view(tiles, TILE_ROWS, chunks, 32, 2)  # [tile, g, chunk, pair, byte]
        out[expert] = _exchange_nibbles(pairs).permute(0, 2, 1, 3, 4).reshape(tiles, chunks, TILE_ROWS, 64)
    return out


def released_layout(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of `mma_layout` (a new tensor): the released codes [E, rows, cols / 2]."""
    held, tiles, chunks, _, _ = tiled.shape
    pairs = tiled.reshape(held, tiles, chunks, TILE_ROWS, 32, 2).permute(0, 1, 3, 2, 4, 5)  # [E, tile, g, chunk, pair, byte]
    return _exchange_nibbles(pairs).reshape(held, tiles * TILE_ROWS, chunks * CHUNK // 2)


def in_code_order(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, cols] with its columns as the Triton kernels pair them with the laid-out codes (a new
    tensor): they read a row's bytes in order, byte j giving positions 2j (low nibble) and 2j + 1
    (high), so each run of 4 positions holds columns 0, 2, 1, 3 of its 4 (CODE_ORDER)."""
    tokens, cols = x.shape
    return x.reshape(tokens, cols // 4, 2, 2).transpose(2, 3).reshape(tokens, cols)


CODE_ORDER = in_code_order(torch.arange(CHUNK)[None])[0]


def from_released(codes: torch.Tensor, scales: torch.Tensor) -> MXFP4MMAExperts:
    """A laid-out copy of released MXFP4 experts (the released tensors are left as they are)."""
    return MXFP4MMAExperts(mma_layout(codes), scales.contiguous(), small_scales(scales))
