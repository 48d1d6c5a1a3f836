"""Pages and slots of the hybrid cache, handed out to requests (pure Python, no torch).

A request holds one fixed-state slot (window rings, open compressor groups, Engram look-back) and a
block table: page i covers its tokens [i * block_tokens, (i + 1) * block_tokens) in every paged layer.
Pages are reference counted so that the prefix cache can share them: a page with a nonzero count is
held; a page whose count fell to zero but whose contents a cache may still reuse is "cached" (it counts
as free: it is evicted, oldest first, when the free list runs dry); every other page is free.
`check_integrity` asserts free + held + cached == total and that the counts match the tables.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStats:
    total: int
    free: int
    held: int
    cached: int
    slots_total: int
    slots_free: int

    @property
    def usage(self) -> float:
        """Share of pages held by running requests (vLLM's kv_cache_usage)."""
        return self.held / self.total if self.total else 0.0


class BlockManager:
    def __init__(self, num_pages: int, block_tokens: int, num_slots: int) -> None:
        self.num_pages, self.block_tokens, self.num_slots = num_pages, block_tokens, num_slots
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.cached_pages: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self.ref_counts = [0] * num_pages
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def available_pages(self) -> int:
        return len(self.free_pages) + len(self.cached_pages)

    def has_slot(self) -> bool:
        return bool(self.free_slots)

    def open(self, request_id: str) -> int:
        """Gives a request a slot and an empty block table."""
        assert request_id not in self.slots, f"{request_id} already holds a slot"
        slot = self.free_slots.pop()
        self.slots[request_id], self.tables[request_id] = slot, []
        return slot

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Makes the request's table cover `num_tokens`; False (and nothing taken) if pages run out."""
        table = self.tables[request_id]
        missing = self.pages_for(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.available_pages:
            return False
        for _ in range(missing):
            page = self.free_pages.pop() if self.free_pages else self.cached_pages.popitem(last=False)[0]
            self.ref_counts[page] = 1
            table.append(page)
        return True

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def close(self, request_id: str) -> None:
        """Releases the request's pages and slot (finish, abort, failure or preemption)."""
        for page in self.tables.pop(request_id, []):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def stats(self) -> BlockStats:
        held = self.num_pages - len(self.free_pages) - len(self.cached_pages)
        return BlockStats(self.num_pages, len(self.free_pages), held, len(self.cached_pages), self.num_slots, len(self.free_slots))

    def check_integrity(self) -> None:
        free, cached = set(self.free_pages), set(self.cached_pages)
        assert len(free) == len(self.free_pages), "a page is on the free list twice"
        assert not free & cached, "a page is both free and cached"
        counts = [0] * self.num_pages
        for table in self.tables.values():
            for page in table:
                counts[page] += 1
        assert counts == self.ref_counts, "reference counts do not match the block tables"
        held = {p for p, c in enumerate(counts) if c > 0}
        assert not held & (free | cached), "a held page is also free or cached"
        assert len(free) + len(cached) + len(held) == self.num_pages, "pages leaked: free + held + cached != total"
        slots = list(self.slots.values())
        assert len(set(slots)) == len(slots), "a slot is held twice"
        assert sorted(slots + self.free_slots) == list(range(self.num_slots)), "slots leaked"
