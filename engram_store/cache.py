"""Row cache for Engram rows: a fixed array of row slots, a row -> slot index and a CLOCK policy with
hit credits, every operation over a whole batch of rows.

n-gram traffic is Zipfian: a small head of rows is hit over and over, a long tail once. Plain LRU
lets a burst of one-off tail rows flush the head. Here a new row enters with no credit and each hit
adds one (up to MAX_CREDIT); the clock hand evicts the first slot it finds without credit and takes
one credit from every slot it passes. A one-off row is gone at the hand's next pass, a head row
survives MAX_CREDIT passes without a hit (the GCLOCK family; `python -m bench.row_cache` measures the
hit rate against plain LRU on a Zipf trace). Lookups are one dict read per row and one array update
per batch, inserts one sweep and one storage copy per batch: no Python loop per row on the paths the
model's thread and the I/O thread take every step.

The storage is one preallocated tensor (host RAM or device memory): the cache never allocates after
construction. A host cache serving a GPU keeps its rows in pinned, mapped memory
(kernels/host_memory.py): the I/O thread writes them with memory copies, the model's step gathers
the hits on the GPU straight from it (`view`), so a hit costs no host gather, staging or transfer.
Callers serialise access (DiskLayer's lock).

A warm step on the device (store.py's DiskTier) never touches the host's bookkeeping: it looks its rows
up in `device_index` and counts its hits in device tensors (`count_hits_on_device`: a credit per
distinct slot, capped when folded, and a distinct-hit total); the host folds them into the CLOCK's credits and `hits` before
it next claims slots (`fold_hits`, under the lock, after the step's gathers finished), so the policy
sees the same credits it would have seen counted one step at a time. Device writes of the index and
the counters are ordered before later lookups by `changed`, an event the lookups' stream waits for.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np
import torch

from engram_store.slot_index import DeviceSlotIndex
from kernels.host_memory import mapped_host_bytes
from kernels.slot_lookup import count_hits

MAX_CREDIT = 3
FREE = -1  # row_of_slot of a slot no row holds


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
        self.index: dict[int, int] = {}
        self.device_index = DeviceSlotIndex(self.capacity, self.view.device)  # the same map, for steps' lookups
        self.row_of_slot = np.full(self.capacity, FREE, dtype=np.int64)
        self.credit = np.zeros(self.capacity, dtype=np.uint8)
        self.hand = 0
        self._hits = self.misses = 0
        self.device_credit = torch.zeros(self.capacity, dtype=torch.int32, device=self.view.device)  # unfolded
        self.device_hits = torch.zeros(1, dtype=torch.int32, device=self.view.device)  # unfolded distinct hits
        self.device_stamps = torch.zeros(self.capacity, dtype=torch.int32, device=self.view.device)
        self.counts = 0  # count_hits_on_device calls: each stamps the slots it sees with its number
        self.changed: torch.cuda.Event | None = None  # the last device write of the index or the counters

    @property
    def device_bytes(self) -> int:
        """Device memory of the bookkeeping a warm step reads and writes: the index, credits and stamps."""
        counters = (self.device_credit, self.device_hits, self.device_stamps)
        return self.device_index.device_bytes + sum(t.numel() * t.element_size() for t in counters)

    @property
    def hits(self) -> int:
        """Distinct rows hit, per lookup or step, since construction (folded or not)."""
        return self._hits + int(self.device_hits)

    def __len__(self) -> int:
        return len(self.index)

    def clear(self) -> None:
        """Forgets every row (the storage keeps its bytes, unreachable)."""
        self.index.clear()
        self.fold_hits()
        self.device_index.clear()
        self.row_of_slot.fill(FREE)
        self.credit.fill(0)
        self.hand = 0
        self._changed()

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """Slot of each row, FREE where the row is not cached; no credit, no counting."""
        return np.fromiter(map(self.index.get, rows.tolist(), repeat(FREE)), dtype=np.int64, count=len(rows))

    def lookup(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For distinct `rows`: (hit mask, slots of the hits); each hit earns its row a credit."""
        slots = self.slots_of(rows)
        hit = slots != FREE
        self.credit_hits(slots[hit])
        self.misses += len(rows) - len(slots[hit])
        return hit, slots[hit]

    def credit_hits(self, slots: np.ndarray) -> None:
        """Counts a hit on each distinct slot of `slots` (repeats allowed) and gives it one credit."""
        self._hits += len(set(slots.tolist()))
        self.credit[slots] = np.minimum(self.credit[slots] + 1, MAX_CREDIT)

    def device_slots_of(self, rows: torch.Tensor, misses: torch.Tensor | None = None, which: int = 0) -> torch.Tensor:
        """`slots_of` for row ids on the device the steps read from (`view`'s): looked up there in the
        device index, by ops whose count does not depend on how many rows (FREE where not cached); the
        uncached rows' count added to misses[which] if given. No credit and no counting: a warm step's
        lookup stays off the host."""
        if self.changed is not None:
            torch.cuda.current_stream(self.view.device).wait_event(self.changed)
        return self.device_index.lookup(rows, misses, which)

    def count_hits_on_device(self, slots: torch.Tensor) -> None:
        """`credit_hits` for cached `slots` (a device tensor, any shape, repeats allowed) without a host
        read: each distinct slot gains a credit and the distinct count adds to `device_hits`, one kernel
        on CUDA (kernels/slot_lookup.count_hits). Folded by `fold_hits`."""
        self.counts = self.counts % (2**31 - 2) + 1
        count_hits(slots, self.device_stamps, self.device_credit, self.device_hits, self.counts)

    def fold_hits(self) -> int:
        """Moves the device's hit counts into the CLOCK's credits and `hits` (one scalar read, the
        credits only if some hit); returns the distinct hits folded. The caller makes sure the steps
        that counted them have finished (DiskLayer waits for their gathers first)."""
        folded = int(self.device_hits)
        if folded:
            pending = self.device_credit.cpu().numpy()
            # capped once here, as capped one step at a time: min(min(c + 1, M) + 1, M) = min(c + 2, M)
            self.credit[:] = np.minimum(self.credit.astype(np.int64) + pending, MAX_CREDIT)
            self.device_credit.zero_()
            self.device_hits.zero_()
            self._hits += folded
            self._changed()
        return folded

    def _changed(self) -> None:
        """After the device index or counters were written: lookups queued later wait for the writes."""
        if self.view.is_cuda:
            self.changed = torch.cuda.Event()
            self.changed.record(torch.cuda.current_stream(self.view.device))

    def absent(self, rows: np.ndarray) -> np.ndarray:
        """Mask of the rows not cached; no credit and no hit counting (prefetch hints use it)."""
        return self.slots_of(rows) == FREE

    def insert(self, rows: np.ndarray, data: torch.Tensor) -> None:
        """Adds distinct rows with their bytes [n, row_bytes], evicting by the clock. Rows already
        cached are skipped: a hint's read and a step's read of the same row can both finish."""
        fresh = self.slots_of(rows) == FREE
        if not fresh.all():
            rows, data = rows[fresh], data[torch.from_numpy(fresh)]
        if self.capacity == 0 or len(rows) == 0:
            return
        self.fold_hits()  # the credits the clock reads include the device's hits, on the slots that earned them
        if len(rows) > self.capacity:
            rows, data = rows[-self.capacity :], data[-self.capacity :]
        slots = self._claim(len(rows))
        evicted = self.row_of_slot[slots]
        deque(map(self.index.__delitem__, evicted[evicted != FREE].tolist()), maxlen=0)
        self.index.update(zip(rows.tolist(), slots.tolist()))
        self.device_index.remove(evicted[evicted != FREE])
        self.device_index.insert(rows, slots)
        self.row_of_slot[slots] = rows
        self.credit[slots] = 0
        target = torch.from_numpy(slots)
        self.storage[target.to(self.storage.device)] = data.to(self.storage.device)
        self._changed()

    def check_integrity(self) -> None:
        """The row -> slot index and each slot's owner agree both ways (a lookup can never return
        another row's bytes), credits are in range and the hand points at a slot."""
        rows = np.fromiter(self.index.keys(), dtype=np.int64, count=len(self.index))
        slots = np.fromiter(self.index.values(), dtype=np.int64, count=len(self.index))
        assert len(rows) == int((self.row_of_slot != FREE).sum()), "the index and the slots hold different row counts"
        assert ((0 <= slots) & (slots < self.capacity)).all(), "an index entry points outside the cache"
        assert np.array_equal(self.row_of_slot[slots], rows), "an index entry points at a slot another row holds"
        assert (self.credit <= MAX_CREDIT).all(), "a slot holds more credit than MAX_CREDIT"
        assert self.capacity == 0 or int(self.device_credit.min()) >= 0, "a negative unfolded credit"
        assert self.capacity == 0 or 0 <= self.hand < self.capacity, "the clock hand is off the slots"
        self.device_index.check_integrity(self.index)

    def _claim(self, n: int) -> np.ndarray:
        """n distinct slots: the hand's next slots without credit (free slots have none), taking one
        credit from each slot it passes on the way. Terminates: every full turn of the hand lowers
        every passed credit, so within MAX_CREDIT + 1 turns every slot qualifies."""
        claimed: list[np.ndarray] = []
        need = n
        while need:
            end = min(self.capacity, self.hand + 4 * need + 64)  # the window stops at the end; the hand wraps
            credit = self.credit[self.hand : end]
            free = np.flatnonzero(credit == 0)[:need]
            passed = end - self.hand if len(free) < need else int(free[-1]) + 1
            np.subtract(credit[:passed], 1, out=credit[:passed], where=credit[:passed] > 0)  # a view: in place
            chosen = free + self.hand
            self.credit[chosen] = MAX_CREDIT + 1  # not chosen twice by a later turn of this claim
            claimed.append(chosen)
            need -= len(chosen)
            self.hand = (self.hand + passed) % self.capacity
        return np.concatenate(claimed) if len(claimed) > 1 else claimed[0]
