"""Paged V4.1 compressed KV entries and index keys kept as packed FP4 (`memory.kv_cache_dtype: fp4`).

V4.1 rounds both to FP4 inside its forward (kernels/fake_quant.py): entries to E2M1 with a float8_e4m3fn
scale per 16 channels, index keys to E2M1 with a power-of-two scale per 32. Stored as the model's
bf16 numbers that is 16 bits for a 4-bit value; packed (kernels/kv_pack.py) a 512-wide entry takes
288 bytes instead of 1,024 in bf16 (2,048 in float32), and reads give back exactly the numbers the
unpacked cache holds, because writes pack the values *before* rounding with the same helpers the
model's rounding uses (packing an already-rounded entry would not always give it back).

`PackedPages` offers what the paged helpers of models/cache.py do with a plain [pages, per_page, dim]
tensor (read a sequence's first entries, gather entries by id, write entries, with block tables),
so the attention code reads either kind through the same calls. Every operation is a fixed-shape
torch op: the decode path over packed pages is capturable too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_pack import PackedFP4, pack_fp4_e4m3, pack_fp4_ue8m0, unpack_fp4

PACKERS = {"e4m3": (pack_fp4_e4m3, 16), "ue8m0": (pack_fp4_ue8m0, 32)}


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
    codes: torch.Tensor  # uint8 [pages, per_page, dim / 2], two E2M1 codes a byte
    scales: torch.Tensor  # uint8 [pages, per_page, dim / block]: e4m3 bytes or E8M0 exponents
    scale_format: str  # "e4m3" (compressed KV entries) | "ue8m0" (index keys)
    dtype: torch.dtype  # what reads return: the dtype the unpacked cache would hold

    @classmethod
    def allocate(cls, pages: int, per_page: int, dim: int, scale_format: str, dtype: torch.dtype,
                 device: torch.device | str) -> "PackedPages":
        block = PACKERS[scale_format][1]
        if dim % block:
            raise ValueError(f"packed FP4 needs a width that is a multiple of {block}, not {dim}")
        codes = torch.zeros(pages, per_page, dim // 2, dtype=torch.uint8, device=device)
        scales = torch.zeros(pages, per_page, dim // block, dtype=torch.uint8, device=device)
        return cls(codes, scales, scale_format, dtype)

    @property
    def shape(self) -> torch.Size:
        """[pages, per_page, dim], as the unpacked tensor's."""
        return torch.Size((*self.codes.shape[:2], 2 * self.codes.shape[2]))

    def tensors(self) -> list[torch.Tensor]:
        """The byte tensors, page first (what page copies and byte counts walk)."""
        return [self.codes, self.scales]

    def unpack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        block = PACKERS[self.scale_format][1]
        return unpack_fp4(PackedFP4(codes, scales, block, self.scale_format), self.dtype)

    def at(self, page: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Entries at (page, index) pairs of any matching shapes -> [*shape, dim]."""
        return self.unpack(gather_rows(self.codes, page, index), gather_rows(self.scales, page, index))

    def pages(self, tables: torch.Tensor) -> torch.Tensor:
        """Whole pages: tables [...] -> [..., per_page, dim]."""
        return self.unpack(self.codes[tables], self.scales[tables])

    def put(self, page: torch.Tensor, index: torch.Tensor, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Packs `values` [n, dim] (before FP4 rounding) into (page, index); with `where` [n] only there."""
        self.put_packed(page, index, self.pack(values), where)

    def pack(self, values: torch.Tensor) -> PackedFP4:
        """Entries [n, dim] before FP4 rounding -> their code and scale bytes."""
        return PACKERS[self.scale_format][0](values)

    def put_packed(self, page: torch.Tensor, index: torch.Tensor, packed: PackedFP4, where: torch.Tensor | None = None) -> None:
        """Stores already packed entries at (page, index); with `where` [n] only there."""
        codes, scales = packed.codes, packed.scales
        if where is not None:
            codes = torch.where(where[:, None], codes, self.codes[page, index])
            scales = torch.where(where[:, None], scales, self.scales[page, index])
        self.codes[page, index] = codes
        self.scales[page, index] = scales
