"""Paged compressed KV entries and index keys kept packed (`memory.kv_cache_dtype: fp4` or `fp8`).

fp4: V4.1 rounds both to FP4 inside its forward (kernels/fake_quant.py): entries to E2M1 with a
float8_e4m3fn scale per 16 channels, index keys to E2M1 with a power-of-two scale per 32. Stored as the
model's bf16 numbers that is 16 bits for a 4-bit value; packed (kernels/kv_pack.py) a 512-wide entry
takes 288 bytes instead of 1,024 in bf16 (2,048 in float32), and reads give back exactly the numbers
the unpacked cache holds, because writes pack the values *before* rounding with the same helpers the
model's rounding uses (packing an already-rounded entry would not always give it back).

fp8 (V4; vLLM's fp8 / fp8_ds_mla): float8_e4m3fn values with a float32 scale per 64 channels; a
compressed KV entry keeps its RoPE channels (the last rope_head_dim) in bfloat16 as fp8_ds_mla does
(V4-Flash: 448 + 28 + 128 = 604 bytes instead of 1,024), an index key is e4m3 over all its channels
(128 + 8 = 136 instead of 256). Lossy, with the bounds kernels/kv_pack.py states.

`PackedPages` offers what the paged helpers of models/cache.py do with a plain [pages, per_page, dim]
tensor (read a sequence's first entries, gather entries by id, write entries, with block tables),
so the attention code reads either kind through the same calls. It keeps one uint8 page tensor per
part of its codec (FP4: codes and scales; FP8: codes, scales and the bf16 tail) and is the same code
for every codec. Every operation is a fixed-shape torch op: the decode path over packed pages is
capturable too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.kv_pack import (
    FP8_BLOCK,
    PackedFP4,
    PackedFP8,
    fp8_widths,
    pack_fp4_e4m3,
    pack_fp4_ue8m0,
    pack_fp8,
    unpack_fp4,
    unpack_fp8,
)

PACKERS = {"e4m3": (pack_fp4_e4m3, 16), "ue8m0": (pack_fp4_ue8m0, 32)}


@dataclass(frozen=True)
class FP4Codec:
    """E2M1 code pairs and a scale byte per block: "e4m3" (compressed KV entries, per 16) or "ue8m0"
    (index keys, power-of-two per 32)."""

    scale_format: str

    @property
    def name(self) -> str:
        return self.scale_format

    def widths(self, dim: int) -> tuple[int, ...]:
        block = PACKERS[self.scale_format][1]
        if dim % block:
            raise ValueError(f"packed FP4 needs a width that is a multiple of {block}, not {dim}")
        return (dim // 2, dim // block)

    def dim(self, widths: tuple[int, ...]) -> int:
        return 2 * widths[0]

    def pack(self, values: torch.Tensor) -> PackedFP4:
        return PACKERS[self.scale_format][0](values)

    def unpack(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        codes, scales = parts
        return unpack_fp4(PackedFP4(codes, scales, PACKERS[self.scale_format][1], self.scale_format), dtype)


@dataclass(frozen=True)
class FP8Codec:
    """e4m3 codes with a float32 scale per `block` channels; the last `tail` channels in bfloat16."""

    tail: int = 0
    block: int = FP8_BLOCK

    @property
    def name(self) -> str:
        return "fp8"

    def widths(self, dim: int) -> tuple[int, ...]:
        return fp8_widths(dim, self.tail, self.block)

    def dim(self, widths: tuple[int, ...]) -> int:
        return widths[0] + self.tail

    def pack(self, values: torch.Tensor) -> PackedFP8:
        return pack_fp8(values, self.tail, self.block)

    def unpack(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return unpack_fp8(PackedFP8(parts[0], parts[1], parts[2] if self.tail else None, self.block), dtype)


Codec = FP4Codec | FP8Codec


def gather_rows(data: torch.Tensor, page: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """data[page, index] for a uint8 [pages, per_page, n] tensor, moved as the widest words that divide
    a row (an entry's 256 code bytes as 32 int64): 8x fewer elements to gather, and over PCIe (the host
    tier's reads) far fewer, wider requests. Bitwise the byte gather."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if data.shape[-1] % size == 0 and data.storage_offset() % size == 0 and data.data_ptr() % size == 0:
            return data.view(word)[page, index].view(torch.uint8)
    return data[page, index]


@dataclass
class PackedPages:
    codes: torch.Tensor  # uint8 [pages, per_page, ...]: two E2M1 codes a byte (fp4) or e4m3 bytes (fp8)
    scales: torch.Tensor  # uint8 [pages, per_page, ...]: e4m3 bytes or E8M0 exponents (fp4), float32 bytes (fp8)
    codec: Codec | str  # a codec, or an FP4 scale format: "e4m3" (compressed KV entries) | "ue8m0" (index keys)
    dtype: torch.dtype  # what reads return: the dtype the unpacked cache would hold
    tail: torch.Tensor | None = field(default=None)  # fp8 with a tail: uint8 [pages, per_page, 2 * tail] bf16 bytes

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):
            self.codec = FP4Codec(self.codec)

    @classmethod
    def allocate(cls, pages: int, per_page: int, dim: int, codec: Codec | str, dtype: torch.dtype,
                 device: torch.device | str) -> "PackedPages":
        codec = FP4Codec(codec) if isinstance(codec, str) else codec
        parts = [torch.zeros(pages, per_page, width, dtype=torch.uint8, device=device) for width in codec.widths(dim)]
        return cls(parts[0], parts[1], codec, dtype, parts[2] if len(parts) > 2 else None)

    @property
    def scale_format(self) -> str:
        """The codec's name: "e4m3" / "ue8m0" (FP4) or "fp8"."""
        return self.codec.name

    @property
    def shape(self) -> torch.Size:
        """[pages, per_page, dim], as the unpacked tensor's."""
        widths = tuple(t.shape[2] for t in self.tensors())
        return torch.Size((*self.codes.shape[:2], self.codec.dim(widths)))

    def tensors(self) -> list[torch.Tensor]:
        """The byte tensors, page first (what page copies and byte counts walk)."""
        return [self.codes, self.scales] + ([] if self.tail is None else [self.tail])

    def unpack(self, *parts: torch.Tensor) -> torch.Tensor:
        """Entries from their gathered parts, in `tensors()` order."""
        return self.codec.unpack(parts, self.dtype)

    def at(self, page: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Entries at (page, index) pairs of any matching shapes -> [*shape, dim]."""
        return self.unpack(*(gather_rows(t, page, index) for t in self.tensors()))

    def pages(self, tables: torch.Tensor) -> torch.Tensor:
        """Whole pages: tables [...] -> [..., per_page, dim]."""
        return self.unpack(*(t[tables] for t in self.tensors()))

    def put(self, page: torch.Tensor, index: torch.Tensor, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Packs `values` [n, dim] (fp4: before FP4 rounding) into (page, index); with `where` [n] only there."""
        self.put_packed(page, index, self.pack(values), where)

    def pack(self, values: torch.Tensor) -> PackedFP4 | PackedFP8:
        """Entries [n, dim] (fp4: before FP4 rounding) -> their bytes, one tensor per part."""
        return self.codec.pack(values)

    def put_packed(self, page: torch.Tensor, index: torch.Tensor, packed: PackedFP4 | PackedFP8,
                   where: torch.Tensor | None = None) -> None:
        """Stores already packed entries at (page, index); with `where` [n] only there."""
        for store, part in zip(self.tensors(), packed.parts(), strict=True):
            if where is not None:
                part = torch.where(where[:, None], part, store[page, index])
            store[page, index] = part
