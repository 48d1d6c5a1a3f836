"""Row cache lookups on the device: a torch reference and a Triton kernel.

A row cache's row -> slot map lives in a device hash table (engram_store/slot_index.py: open
addressing, Fibonacci-hashed homes, at most MAX_PROBE displacements). A warm decode step looks every
Engram row of the step up there. The reference does it with torch ops, five a probe: with 17 probes
that is ~85 launches per layer and cache, ~10 us of host time each, which is what a warm step's host
time was made of on the H200 (bench.engram's graph_engram_wait_ms, fifteenth session). The kernel is
one launch: each program probes its rows in registers and adds its misses to a counter, so the host
reads one small tensor of miss counts for the whole step.

The hits of the rows a warm step gathers are counted on the device too (`count_hits`): each distinct
slot gains a credit and the distinct count adds to a total, as the host's CLOCK would have counted
them. The reference finds the distinct slots with torch.unique; the kernel stamps each slot it sees
with the call's number (an atomic exchange: the lane that swaps the old number out is the slot's
first this call), so one launch replaces the dozen ops of a sort and scatter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

LOOKUP_BLOCK = 128


def slot_lookup(rows: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, bits: int, mix: int, probes: int,
                misses: torch.Tensor | None = None, which: int = 0) -> torch.Tensor:
    """Slot of each row id of `rows` (int64, any shape) in the table (`keys`, `slots`: int64 [2**bits]),
    -1 where absent; `probes` entries from each row's home. With `misses` (int32 counters), the count of
    absent rows is added to misses[which]. The kernel on CUDA, the reference elsewhere."""
    if triton is not None and rows.is_cuda:
        return slot_lookup_triton(rows, keys, slots, bits, mix, probes, misses, which)
    return slot_lookup_reference(rows, keys, slots, bits, mix, probes, misses, which)


def count_hits(slots: torch.Tensor, stamps: torch.Tensor, credits: torch.Tensor, hits: torch.Tensor,
               stamp: int) -> None:
    """Each distinct slot of `slots` (any shape, repeats allowed) adds 1 to its `credits` entry (int32,
    uncapped: the host caps when it folds them in) and their count adds to `hits` (int32 [1]).
    `stamps` (int32, one per slot) and `stamp` (a number no earlier call used, > 0) are the kernel's
    record of which slots this call saw; the reference ignores them."""
    if triton is not None and slots.is_cuda:
        count_hits_triton(slots, stamps, credits, hits, stamp)
    else:
        count_hits_reference(slots, credits, hits)


def count_hits_reference(slots: torch.Tensor, credits: torch.Tensor, hits: torch.Tensor) -> None:
    distinct = torch.unique(slots.reshape(-1))
    credits[distinct] += 1
    hits += distinct.numel()


def count_hits_triton(slots: torch.Tensor, stamps: torch.Tensor, credits: torch.Tensor, hits: torch.Tensor,
                      stamp: int) -> None:
    flat = slots.reshape(-1).contiguous()
    if flat.numel():
        _count_hits_kernel[(triton.cdiv(flat.numel(), LOOKUP_BLOCK),)](
            flat, stamps, credits, hits, flat.numel(), stamp, BLOCK=LOOKUP_BLOCK)


def home_entries(rows, bits: int, mix: int):
    """Home entry of each row id: the top `bits` bits of row * mix (wrapping int64 multiply), for int64
    tensors and numpy arrays alike (the slot index's host mirror places keys by the same homes)."""
    return ((rows * mix) >> (64 - bits)) & ((1 << bits) - 1)


def slot_lookup_reference(rows: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, bits: int, mix: int,
                          probes: int, misses: torch.Tensor | None = None, which: int = 0) -> torch.Tensor:
    home = home_entries(rows, bits, mix)
    found = torch.full_like(rows, -1)
    for step in range(probes):
        entry = (home + step) & ((1 << bits) - 1)
        found = torch.where(keys[entry] == rows, slots[entry], found)
    if misses is not None:
        misses[which] += (found < 0).sum().to(misses.dtype)
    return found


def slot_lookup_triton(rows: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, bits: int, mix: int,
                       probes: int, misses: torch.Tensor | None = None, which: int = 0) -> torch.Tensor:
    flat = rows.reshape(-1).contiguous()
    out = torch.empty_like(flat)
    count = flat.numel()
    if count:
        counter = misses[which:] if misses is not None else out  # unused without COUNT
        _slot_lookup_kernel[(triton.cdiv(count, LOOKUP_BLOCK),)](
            flat, keys, slots, out, counter, count, 64 - bits, (1 << bits) - 1, mix,
            PROBES=probes, COUNT=misses is not None, BLOCK=LOOKUP_BLOCK)
    return out.view(rows.shape)


if triton is not None:

    @triton.jit
    def _slot_lookup_kernel(rows_ptr, keys_ptr, slots_ptr, out_ptr, misses_ptr, count, shift, mask_bits, mix,
                            PROBES: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offsets < count
        rows = tl.load(rows_ptr + offsets, mask=live, other=0)
        home = ((rows * mix) >> shift) & mask_bits
        found = tl.full([BLOCK], -1, tl.int64)
        for step in tl.static_range(PROBES):
            entry = (home + step) & mask_bits
            key = tl.load(keys_ptr + entry, mask=live, other=-1)
            slot = tl.load(slots_ptr + entry, mask=live, other=-1)
            found = tl.where(key == rows, slot, found)
        tl.store(out_ptr + offsets, found, mask=live)
        if COUNT:
            tl.atomic_add(misses_ptr, tl.sum((live & (found < 0)).to(tl.int32), axis=0))

    @triton.jit
    def _count_hits_kernel(slots_ptr, stamps_ptr, credits_ptr, hits_ptr, count, stamp, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offsets < count
        slot = tl.load(slots_ptr + offsets, mask=live, other=0)
        before = tl.atomic_xchg(stamps_ptr + slot, tl.full([BLOCK], stamp, tl.int32), mask=live)
        first = live & (before != stamp)
        tl.atomic_add(credits_ptr + slot, tl.full([BLOCK], 1, tl.int32), mask=first)
        tl.atomic_add(hits_ptr, tl.sum(first.to(tl.int32), axis=0))
