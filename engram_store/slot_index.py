"""A row -> slot index of a RowCache that lives in a tensor, so a step looks its rows up where its
row ids are (the compute device): one kernel on CUDA (kernels/slot_lookup.py), torch ops elsewhere;
no host sync, no per-row Python work.

Open addressing with linear probing in a power-of-two table of at least twice the cache's capacity
(load <= 1/2). The host path that fills the cache (RowCache.insert / clear, under the caller's lock)
keeps a numpy mirror and places keys there with vectorised probing rounds, then copies only the
changed entries to the device tensors. Evicted keys become tombstones (reusable by later inserts).
No key sits more than MAX_PROBE entries past its home: when an insert would, the live keys are
re-placed into an empty table (tombstones dropped), twice as large if that is still not enough. So a
lookup scans exactly MAX_PROBE + 1 entries, needs no stop at an empty one, and queues the same ops
whatever the rows and the table's state are (what a CUDA graph can capture; only a growth moves the
device tensors).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.slot_lookup import home_entries, slot_lookup

EMPTY = -1  # an entry no key ever took
TOMB = -2  # an entry whose key was evicted: lookups pass it, inserts may reuse it
MAX_PROBE = 16  # rebuild once some key sits further than this from its home entry
_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing


class DeviceSlotIndex:
    def __init__(self, capacity: int, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._allocate(max(1, int(2 * max(capacity, 1) - 1).bit_length()))

    def _allocate(self, bits: int) -> None:
        """An empty table of 2**bits entries, mirror and device tensors."""
        self.bits, self.size = bits, 1 << bits
        self.keys = np.full(self.size, EMPTY, dtype=np.int64)
        self.slots = np.full(self.size, -1, dtype=np.int64)
        self.max_probe = 0
        self.device_keys = torch.full((self.size,), EMPTY, dtype=torch.int64, device=self.device)
        self.device_slots = torch.full((self.size,), -1, dtype=torch.int64, device=self.device)

    @property
    def device_bytes(self) -> int:
        """Memory the device tensors hold: 16 bytes an entry, 2 to 4 entries a cached row."""
        return sum(t.numel() * t.element_size() for t in (self.device_keys, self.device_slots))

    def clear(self) -> None:
        """Forgets every row (the table keeps its size)."""
        self.keys.fill(EMPTY)
        self.slots.fill(-1)
        self.max_probe = 0
        self.device_keys.fill_(EMPTY)
        self.device_slots.fill_(-1)

    def remove(self, rows: np.ndarray) -> None:
        """Drops distinct cached `rows` (evicted): their entries become tombstones."""
        if len(rows):
            self._publish(self._find(rows), TOMB, -1)

    def insert(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Adds distinct `rows` (not in the index) at `slots`, one vectorised probing round per
        displacement: each round, every pending row takes its candidate entry if it is free and no
        earlier pending row wants the same entry."""
        self._publish(self._place(rows), rows, slots)
        if self.max_probe > MAX_PROBE:
            self._rebuild()

    def _place(self, rows: np.ndarray) -> np.ndarray:
        """Claims a mirror entry for each of `rows` (keys only) and returns the entries."""
        positions = np.empty(len(rows), dtype=np.int64)
        pending = np.arange(len(rows))
        home = home_entries(rows, self.bits, _MIX)  # numpy's wrapping int64 multiply: the kernel's bits
        step = 0
        while len(pending):
            candidate = (home[pending] + step) & (self.size - 1)
            free = self.keys[candidate] < 0
            _, first = np.unique(candidate, return_index=True)
            wins = np.zeros(len(pending), dtype=bool)
            wins[first] = True
            wins &= free
            self.keys[candidate[wins]] = rows[pending[wins]]  # claim now so later rounds see it taken
            positions[pending[wins]] = candidate[wins]
            if wins.any():
                self.max_probe = max(self.max_probe, step)
            pending = pending[~wins]
            step += 1
        return positions

    def lookup(self, rows: torch.Tensor, misses: torch.Tensor | None = None, which: int = 0) -> torch.Tensor:
        """Slot of each row id of `rows` (any shape, on the index's device), -1 where the row is not
        cached: MAX_PROBE + 1 probes whatever the rows and the table hold, one kernel on CUDA
        (kernels/slot_lookup.py). With `misses` (int32 counters on the device), the absent rows' count
        is added to misses[which]."""
        return slot_lookup(rows, self.device_keys, self.device_slots, self.bits, int(_MIX), MAX_PROBE + 1, misses, which)

    def check_integrity(self, index: dict[int, int]) -> None:
        """The mirror, the device tensors and the cache's dict agree on every live row and slot."""
        live = self.keys >= 0
        assert int(live.sum()) == len(index), "the slot index and the cache hold different row counts"
        assert all(index.get(int(k)) == int(s) for k, s in zip(self.keys[live], self.slots[live])), "a stale entry"
        assert np.array_equal(self.device_keys.cpu().numpy(), self.keys), "device keys differ from the mirror"
        assert np.array_equal(self.device_slots.cpu().numpy(), self.slots), "device slots differ from the mirror"

    def _find(self, rows: np.ndarray) -> np.ndarray:
        """Entry of each of the indexed `rows` in the mirror (vectorised over the probe bound)."""
        home = home_entries(rows, self.bits, _MIX)  # numpy's wrapping int64 multiply: the kernel's bits
        found = np.full(len(rows), -1, dtype=np.int64)
        for step in range(self.max_probe + 1):
            entry = (home + step) & (self.size - 1)
            found = np.where((found < 0) & (self.keys[entry] == rows), entry, found)
        assert (found >= 0).all(), "removing a row the index does not hold"
        return found

    def _publish(self, entries: np.ndarray, keys: np.ndarray | int, slots: np.ndarray | int) -> None:
        """Writes entries in the mirror and copies just those to the device tensors."""
        self.keys[entries], self.slots[entries] = keys, slots
        at = torch.from_numpy(entries).to(self.device_keys.device)
        self.device_keys[at] = torch.from_numpy(self.keys[entries]).to(self.device_keys.device)
        self.device_slots[at] = torch.from_numpy(self.slots[entries]).to(self.device_keys.device)

    def _rebuild(self) -> None:
        """Re-places the live keys into an empty table (tombstones gone), doubling it until no key sits
        more than MAX_PROBE entries past its home."""
        live = self.keys >= 0
        rows, slots = self.keys[live].copy(), self.slots[live].copy()
        bits = self.bits
        while True:
            self._allocate(bits)
            self._place(rows)
            if self.max_probe <= MAX_PROBE:
                break
            bits += 1
        self.keys.fill(EMPTY)
        self.max_probe = 0
        self._publish(self._place(rows), rows, slots)
