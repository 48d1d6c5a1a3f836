"""V4.1's packed compressed KV entries in host memory, with a GPU hot ring of recent pages
(`offload.kv: host_packed`): 500K-token contexts on GPUs whose memory holds a fraction of them.

Decode reads few compressed entries per step: each query attends the top-k entries its index source
picked, not all of them. So the entries can live in host memory, and only the index keys (scored
every step, over every entry; packed FP4 on the device) and the most recent pages stay on the GPU:
- every page of every kv source is written through to the host tier, a shared-memory mapping
  (memfd) that is pinned and mapped into the GPU's address space (`cudaHostRegister`);
- the hot ring holds copies of the last `hot_pages` pages of each sequence in the step, in GPU memory;
- reads are one fixed-shape gather: entries on a hot page come from the ring, the rest straight from
  host memory by the gather kernel itself (zero-copy over PCIe: no staging copy, no host sync, so the
  decode step stays one CUDA graph and the reads overlap the rest of the kernel's work).
The ring is a cache of the host tier: a page made hot is first copied from it, writes go to both,
so any hot set gives bitwise the same reads. On the CPU both tiers are host memory (tests).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels.host_memory import mapped_host_bytes
from models.packed_pages import PACKERS, PackedPages, gather_rows


def host_packed_pages(pages: int, per_page: int, dim: int, scale_format: str, dtype: torch.dtype,
                      device: torch.device | str) -> PackedPages:
    """PackedPages whose code and scale bytes live in one shared host mapping, seen from `device`
    (kernels/host_memory.py)."""
    block = PACKERS[scale_format][1]
    code_bytes, scale_bytes = pages * per_page * dim // 2, pages * per_page * dim // block
    memory = mapped_host_bytes(code_bytes + scale_bytes, device).device
    codes = memory[:code_bytes].view(pages, per_page, dim // 2)
    scales = memory[code_bytes:].view(pages, per_page, dim // block)
    return PackedPages(codes, scales, scale_format, dtype)


@dataclass(frozen=True)
class HostTierSpec:
    """`offload.kv: host_packed` as the cache needs it."""

    hot_tokens: int  # each sequence's most recent tokens whose entries stay on the GPU
    sequences: int  # sequences one step runs at most (the ring holds each one's hot pages)


class HotRing:
    """Which pages the GPU ring holds: `location[page]` is its ring page, -1 when the page is only in
    the host tier. One ring serves every tiered store (all layers address the same page ids); the
    last ring page is a trash page that writes to cold pages aim at. Least recently wanted pages leave
    first."""

    def __init__(self, num_pages: int, ring_pages: int, hot_pages: int, block_tokens: int, device: torch.device | str):
        self.ring_pages, self.hot_pages, self.block_tokens = ring_pages, hot_pages, block_tokens
        self.trash = ring_pages
        self.location = torch.full((num_pages,), -1, dtype=torch.long, device=device)
        self.held: OrderedDict[int, int] = OrderedDict()  # page -> ring page, least recently wanted first
        self.free = list(range(ring_pages - 1, -1, -1))  # ring pages no page holds
        self.stores: list[TieredPages] = []
        self.filled_pages = 0  # pages copied host -> ring so far
        self._last: list[int] = []  # the last step's wanted pages: most steps want the same again

    def wanted(self, pages: list[int] | tuple[int, ...], end_position: int) -> list[int]:
        """The pages of one sequence's block table that must be hot for a step ending at `end_position`:
        its last `hot_pages` pages up to the one holding the step's last token."""
        last = (end_position - 1) // self.block_tokens
        return list(pages[max(0, last - self.hot_pages + 1) : last + 1])

    def hold(self, pages: list[int]) -> None:
        """Makes `pages` hot (copying the ones that were not from the host tier); evicts others."""
        if pages == self._last:
            return
        wanted = list(dict.fromkeys(pages))
        if len(wanted) > self.ring_pages:
            raise ValueError(f"{len(wanted)} hot pages asked for, the ring holds {self.ring_pages}")
        self._last = list(pages)
        for page in wanted:
            if page in self.held:
                self.held.move_to_end(page)
        missing = [page for page in wanted if page not in self.held]
        if not missing:
            return
        evicted: list[int] = []
        if len(missing) > len(self.free):  # the least recently wanted pages this step does not want leave
            keep = set(wanted)
            for page in self.held:
                if page not in keep:
                    evicted.append(page)
                    if len(evicted) == len(missing) - len(self.free):
                        break
        for page in evicted:
            self.free.append(self.held.pop(page))
        locations = [self.free.pop() for _ in missing]
        for page, location in zip(missing, locations):
            self.held[page] = location
        device = self.location.device
        if evicted:
            self.location[torch.tensor(evicted, device=device)] = -1
        self._fill(torch.tensor(missing, device=device), torch.tensor(locations, device=device))
        self.location[torch.tensor(missing, device=device)] = torch.tensor(locations, device=device)

    def refresh(self, pages: list[int]) -> None:
        """Pages whose host copy changed outside `put` (prefix-cache page copies): hot ones re-copied."""
        hot = [page for page in pages if page in self.held]
        if hot:
            device = self.location.device
            self._fill(torch.tensor(hot, device=device), torch.tensor([self.held[p] for p in hot], device=device))

    def _fill(self, pages: torch.Tensor, locations: torch.Tensor) -> None:
        for store in self.stores:
            store.ring.codes[locations] = store.host.codes[pages]
            store.ring.scales[locations] = store.host.scales[pages]
        self.filled_pages += pages.numel()


@dataclass
class TieredPages:
    """A kv source's packed entries: every page in the host tier, hot pages also in the GPU ring. It
    answers the calls of PackedPages (models/cache.py's paged helpers take either)."""

    host: PackedPages  # [pages, per_page, ...] in shared, pinned host memory
    ring: PackedPages  # [ring pages + 1 trash, per_page, ...] on the device
    hot: HotRing

    @classmethod
    def allocate(cls, hot: HotRing, num_pages: int, per_page: int, dim: int, scale_format: str, dtype: torch.dtype,
                 device: torch.device | str) -> "TieredPages":
        host = host_packed_pages(num_pages, per_page, dim, scale_format, dtype, device)
        ring = PackedPages.allocate(hot.ring_pages + 1, per_page, dim, scale_format, dtype, device)
        store = cls(host, ring, hot)
        hot.stores.append(store)
        return store

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    def tensors(self) -> list[torch.Tensor]:
        """The host tier's byte tensors, page first (what page copies walk)."""
        return self.host.tensors()

    def ring_tensors(self) -> list[torch.Tensor]:
        return self.ring.tensors()

    def _where(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hot mask, ring page or the trash page, host page or page 0): both gathers in bounds, and a
        hot entry's host read aims at one fixed address instead of crossing the bus for nothing."""
        location = self.hot.location[page]
        hot = location >= 0
        return hot, torch.where(hot, location, self.hot.trash), torch.where(hot, 0, page)

    def at(self, page: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Entries at (page, index) pairs -> [*shape, dim]: one gather from each tier, one unpack."""
        hot, ring_page, host_page = self._where(page)
        hot = hot.expand(torch.broadcast_shapes(page.shape, index.shape))[..., None]
        codes = torch.where(hot, gather_rows(self.ring.codes, ring_page, index), gather_rows(self.host.codes, host_page, index))
        scales = torch.where(hot, gather_rows(self.ring.scales, ring_page, index), gather_rows(self.host.scales, host_page, index))
        return self.host.unpack(codes, scales)

    def pages(self, tables: torch.Tensor) -> torch.Tensor:
        per_page = self.shape[1]
        return self.at(tables[..., None], torch.arange(per_page, device=tables.device))

    def put(self, page: torch.Tensor, index: torch.Tensor, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Packs once, writes the host tier, and the ring where the page is hot (else its trash page)."""
        packed = self.host.pack(values)
        self.host.put_packed(page, index, packed, where)
        hot, ring_page, _ = self._where(page)
        self.ring.put_packed(ring_page, index, packed, hot if where is None else hot & where)

