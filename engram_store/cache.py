"""Row cache for Engram rows: a fixed array of row slots plus a segmented-LRU index.

n-gram traffic is Zipfian: a small head of rows is hit over and over, a long tail once. Plain LRU
lets a burst of one-off tail rows flush the head; segmented LRU (SLRU) admits new rows into a
probation segment and promotes them to the protected segment (80% of the slots) only on a second hit,
so one-off rows evict each other instead of the head. bench/engram.py measures the hit rate on a
Zipf trace. The storage is one preallocated tensor (host RAM or device memory): the cache never
allocates after construction. A host cache serving a GPU keeps its rows in pinned, mapped memory
(kernels/host_memory.py): the I/O thread writes them with memory copies, the model's step gathers
the hits on the GPU straight from it (`view`), so a hit costs no host gather, staging or transfer.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from kernels.host_memory import mapped_host_bytes

PROTECTED_SHARE = 0.8


class RowCache:
    def __init__(self, capacity_rows: int, row_bytes: int, device: str = "cpu", compute_device: str | None = None) -> None:
        """`device`: where the rows live; `compute_device`: where steps read them (a CUDA device for a
        host cache: the storage is then mapped host memory, `view` its device tensor)."""
        self.capacity = max(0, capacity_rows)
        if torch.device(device).type == "cpu" and compute_device is not None:
            memory = mapped_host_bytes(self.capacity * row_bytes, compute_device)
            self.storage = memory.host.view(self.capacity, row_bytes)
            self.view = memory.device.view(self.capacity, row_bytes)
        else:
            self.storage = torch.zeros(self.capacity, row_bytes, dtype=torch.uint8, device=device)
            self.view = self.storage
        self.probation: OrderedDict[int, int] = OrderedDict()  # row -> slot, oldest first
        self.protected: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        self.protected_limit = int(self.capacity * PROTECTED_SHARE)
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def lookup(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For distinct `rows`: (hit mask, slots of the hits); hits are promoted."""
        hit = np.zeros(len(rows), dtype=bool)
        slots = []
        for i, row in enumerate(rows.tolist()):
            slot = self._touch(row)
            if slot is not None:
                hit[i] = True
                slots.append(slot)
        self.hits += int(hit.sum())
        self.misses += len(rows) - int(hit.sum())
        return hit, np.asarray(slots, dtype=np.int64)

    def absent(self, rows: np.ndarray) -> np.ndarray:
        """Mask of the rows not cached; no promotion and no hit counting (prefetch hints use it)."""
        return np.fromiter((r not in self.protected and r not in self.probation for r in rows.tolist()), bool, len(rows))

    def _touch(self, row: int) -> int | None:
        if row in self.protected:
            self.protected.move_to_end(row)
            return self.protected[row]
        slot = self.probation.pop(row, None)
        if slot is None:
            return None
        self.protected[row] = slot
        if len(self.protected) > self.protected_limit:  # demote the coldest protected row
            demoted, demoted_slot = self.protected.popitem(last=False)
            self.probation[demoted] = demoted_slot
        return slot

    def insert(self, rows: list[int], data: torch.Tensor) -> None:
        """Adds rows (not present) with their bytes [n, row_bytes], evicting probation first."""
        if self.capacity == 0:
            return
        if len(rows) > self.capacity:
            rows, data = rows[-self.capacity :], data[-self.capacity :]
        for row, payload in zip(rows, data):
            slot = self._free_slot()
            self.storage[slot].copy_(payload)
            self.probation[row] = slot

    def _free_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        victim_segment = self.probation if self.probation else self.protected
        return victim_segment.popitem(last=False)[1]
