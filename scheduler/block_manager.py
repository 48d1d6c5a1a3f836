"""Pages and slots of the hybrid cache, handed out to requests (pure Python, no torch).

A request holds one fixed-state slot (window rings, open compressor groups, Engram look-back) and a
block table: page i covers its tokens [i * block_tokens, (i + 1) * block_tokens) in every paged layer.
Pages are reference counted twice: by the block tables of requests (a page some table holds is
"held") and by the prefix cache's state points (a page only points hold is "cached": it counts as free,
because the pool gets it back by evicting points, least recently used first, when the free list runs
dry; scheduler/prefix_cache.py). Every other page is free. `check_integrity` asserts free + held +
cached == total and that the counts match the tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
        self.ref_counts = [0] * num_pages  # block tables holding each page
        self.cache_refs = [0] * num_pages  # prefix-cache points holding each page
        self.num_cached = 0  # pages only points hold
        self.evict: Callable[[], bool] = lambda: False  # drops one cache point (set by the prefix cache)
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def available_pages(self) -> int:
        return len(self.free_pages) + self.num_cached

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
        while len(self.free_pages) < missing and self.evict():
            pass
        assert len(self.free_pages) >= missing, "evicting every cache point must free every cached page"
        for _ in range(missing):
            page = self.free_pages.pop()
            self.ref_counts[page] = 1
            table.append(page)
        return True

    def share(self, request_id: str, pages: Iterable[int]) -> None:
        """Appends pages another sequence computed (a prefix-cache hit) to the request's table."""
        table = self.tables[request_id]
        for page in pages:
            if self.ref_counts[page] == 0:
                self.num_cached -= 1  # cached -> held (shared pages always have a point's reference)
            self.ref_counts[page] += 1
            table.append(page)

    def cache_pages(self, pages: Iterable[int]) -> None:
        """A prefix-cache point now references these pages (held by a request or already cached)."""
        for page in pages:
            assert self.ref_counts[page] or self.cache_refs[page], f"page {page} is free: nothing to cache"
            if self.cache_refs[page] == 0 and self.ref_counts[page] == 0:
                self.num_cached += 1
            self.cache_refs[page] += 1

    def uncache_pages(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.cache_refs[page] -= 1
            if self.cache_refs[page] == 0 and self.ref_counts[page] == 0:
                self.num_cached -= 1
                self.free_pages.append(page)

    def table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def close(self, request_id: str) -> None:
        """Releases the request's pages and slot (finish, abort, failure or preemption)."""
        for page in self.tables.pop(request_id, []):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.cache_refs[page]:
                    self.num_cached += 1
                else:
                    self.free_pages.append(page)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def stats(self) -> BlockStats:
        held = self.num_pages - len(self.free_pages) - self.num_cached
        return BlockStats(self.num_pages, len(self.free_pages), held, self.num_cached, self.num_slots, len(self.free_slots))

    def check_integrity(self, cache_refs: list[int] | None = None) -> None:
        """`cache_refs`: each page's count of prefix-cache points, recounted by the caller."""
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is on the free list twice"
        counts = [0] * self.num_pages
        for table in self.tables.values():
            for page in table:
                counts[page] += 1
        assert counts == self.ref_counts, "reference counts do not match the block tables"
        if cache_refs is not None:
            assert cache_refs == self.cache_refs, "cache references do not match the prefix cache's points"
        held = {p for p, c in enumerate(counts) if c > 0}
        cached = {p for p, c in enumerate(self.cache_refs) if c > 0} - held
        assert len(cached) == self.num_cached, "the cached-page count is off"
        assert not held & free and not cached & free, "a held or cached page is also free"
        assert len(free) + len(cached) + len(held) == self.num_pages, "pages leaked: free + held + cached != total"
        slots = list(self.slots.values())
        assert len(set(slots)) == len(slots), "a slot is held twice"
        assert sorted(slots + self.free_slots) == list(range(self.num_slots)), "slots leaked"
