"""A warm Engram step's lookups off the host: the decode step's row ids hashed by torch ops (bitwise the
host hasher's), and the row cache's device slot index (engram_store/slot_index.py) agreeing with its
dict under insert / evict churn, with a lookup whose op count does not grow with the rows asked."""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engram_store.cache import FREE, RowCache
from engram_store.hashing import DEAD, EngramLayout, NgramHasher
from engram_store.slot_index import MAX_PROBE, DeviceSlotIndex
from engine.memory_plan import model_bytes
from engram_store.store import EngramOptions
from models import ModelCache, load_model


def small_hasher(max_ngram: int = 3, vocab: int = 500) -> NgramHasher:
    rng = np.random.default_rng(1)
    lookup = rng.integers(0, vocab // 2, size=vocab).tolist()  # compressed ids, many raw ids share one
    layout = EngramLayout.build([1, 4], max_ngram, n_heads=4, prime_search_start=1000)
    return NgramHasher(lookup, layout, pad_id=3)


def test_device_hashing_is_bitwise_the_host_hashing_on_random_windows_and_boundaries():
    for max_ngram in (2, 3, 4):
        hasher = small_hasher(max_ngram)
        rng = np.random.default_rng(max_ngram)
        n = 300
        tokens = rng.integers(0, len(hasher.lookup), size=n)
        contexts = hasher.lookup[rng.integers(0, len(hasher.lookup), size=(n, hasher.context_len))]
        dead = rng.random((n, hasher.context_len)) < 0.3  # sequence starts and dead positions, anywhere
        contexts[dead] = DEAD
        contexts[:10] = DEAD  # position 0: no past at all
        expected = hasher.next_row_ids(tokens, contexts)
        got = hasher.next_row_ids_tensor(torch.from_numpy(tokens), torch.from_numpy(contexts))
        assert got.dtype == torch.int64 and np.array_equal(got.numpy(), expected)


def test_device_hashing_of_a_stream_equals_hashing_the_whole_sequence():
    hasher = small_hasher(4)
    sequence = np.random.default_rng(7).integers(0, len(hasher.lookup), size=40).tolist()
    whole, _ = hasher.row_ids(sequence, None, hasher.empty_context())
    context = torch.tensor([hasher.empty_context()])
    for position, token in enumerate(sequence):
        ids = hasher.next_row_ids_tensor(torch.tensor([token]), context)
        assert torch.equal(ids[0], torch.from_numpy(whole[position]))
        context = torch.from_numpy(hasher.advance(context.numpy(), np.array([token])))


def payload(rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(rows.astype("<i8").view(np.uint8).reshape(len(rows), 8).copy())


def test_the_device_index_agrees_with_the_cache_under_churn():
    rng = np.random.default_rng(0)
    cache = RowCache(97, 8)
    for _ in range(300):
        rows = np.unique(rng.integers(0, 3000, size=rng.integers(1, 150)))
        cache.insert(rows, payload(rows))
        asked = rng.integers(0, 3000, size=(7, 5))  # any shape, repeats and misses included
        expected = cache.slots_of(asked.ravel()).reshape(asked.shape)
        assert np.array_equal(cache.device_slots_of(torch.from_numpy(asked)).numpy(), expected)
        assert cache.device_index.max_probe <= MAX_PROBE
        cache.check_integrity()
    cache.clear()
    assert (cache.device_slots_of(torch.arange(3000)) == FREE).all()
    cache.check_integrity()


def test_colliding_rows_all_find_their_slots():
    index = DeviceSlotIndex(64, "cpu")
    rows = np.arange(0, 64 << 20, 1 << 20, dtype=np.int64)  # many share low bits
    index.insert(rows, np.arange(64))
    assert np.array_equal(index.lookup(torch.from_numpy(rows)).numpy(), np.arange(64))
    index.remove(rows[::2])
    assert np.array_equal(index.lookup(torch.from_numpy(rows)).numpy(), np.where(np.arange(64) % 2, np.arange(64), -1))


class CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched inside it (the work a step queues, whatever device runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def warm_lookup_ops(hasher: NgramHasher, cache: RowCache, batch: int) -> int:
    """Torch ops of a warm decode step's hashing and slot lookup for `batch` sequences."""
    rng = np.random.default_rng(batch)
    tokens = torch.from_numpy(rng.integers(0, len(hasher.lookup), size=batch))
    contexts = torch.from_numpy(hasher.lookup[rng.integers(0, len(hasher.lookup), size=(batch, hasher.context_len))])
    rows = torch.from_numpy(np.unique(hasher.next_row_ids(tokens.numpy(), contexts.numpy())))
    cache.insert(rows.numpy(), payload(rows.numpy()))  # warm: every row of the step cached
    cache.device_slots_of(hasher.next_row_ids_tensor(tokens, contexts))  # warm: the hasher's tensors copied
    with CountOps() as counted:
        slots = cache.device_slots_of(hasher.next_row_ids_tensor(tokens, contexts))
    assert (slots != FREE).all()
    return counted.ops


def test_a_warm_steps_hashing_and_lookup_queue_the_same_ops_for_1x_and_16x_rows():
    hasher = small_hasher(3)
    cache = RowCache(4096, 8)
    cache.insert(np.arange(5000, 5600), payload(np.arange(5000, 5600)))  # some churn first
    one, sixteen = warm_lookup_ops(hasher, cache, 4), warm_lookup_ops(hasher, cache, 64)
    assert one == sixteen, (one, sixteen)


class HostWork:
    """A step's host work, counted: Python-level calls (functions and C functions called from Python
    code) and the peak bytes Python objects and numpy arrays take (tracemalloc). Torch's own tensors
    stand in for device memory here (tracemalloc does not see them): a row id that reaches the host,
    as a list, a numpy array or a loop, shows up in one count or the other."""

    def __enter__(self) -> "HostWork":
        self.calls = 0
        tracemalloc.start()
        sys.setprofile(self._count)
        return self

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self.peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def warm_decode_step_work(model, resident, batch: int) -> HostWork:
    """Host work of a warm decode step's Engram fetch for `batch` sequences as the graph runner asks for
    it (the static inputs' slot, token and position columns, on the device), every row in the host
    cache; checks the rows against `resident`'s (the whole table in memory), bitwise."""
    rng = np.random.default_rng(batch)
    hasher = model.engram_memory.hasher
    held = torch.from_numpy(hasher.lookup[rng.integers(0, len(hasher.lookup), size=(batch, hasher.context_len))])
    slots, positions = torch.arange(batch), torch.full((batch,), 9)
    tokens = torch.from_numpy(rng.integers(0, model.config.vocab_size, size=batch))
    cache, reference = (ModelCache.allocate(model.config, batch, 64) for _ in range(2))
    reference.engram_context.copy_(held)
    expected = resident.engram_rows(slots.tolist(), tokens.tolist(), positions.tolist(), reference)
    for run in range(3):  # cold (read from the file, then cached), warm, then counted
        cache.engram_context.copy_(held)
        with HostWork() as work:
            rows = model.engram_rows(slots, tokens, positions, cache)
        assert all(torch.equal(a, b) for a, b in zip(rows, expected)), run
    assert torch.equal(cache.engram_context, reference.engram_context)
    return work


def test_a_warm_decode_steps_host_work_does_not_grow_with_its_engram_rows(checkpoints, tmp_path):
    """The graph runner's Engram fetch of a warm step (disk tier, every row in the host cache): the same
    Python-level calls and about the same host bytes for 16x the rows, and the resident table's rows.
    On the host path both grew with the rows (numpy hashing, a dict lookup and a credit per row)."""
    model = load_model(checkpoints["v41"], engram=EngramOptions(residency="disk", path=tmp_path / "t",
                                                                host_cache_bytes=1 << 24))
    resident = load_model(checkpoints["v41"], engram=EngramOptions(residency="gpu"))
    one, sixteen = warm_decode_step_work(model, resident, 2), warm_decode_step_work(model, resident, 32)
    print(f"warm step host work: 1x rows {one.calls} calls, {one.peak_bytes} B; "
          f"16x rows {sixteen.calls} calls, {sixteen.peak_bytes} B")
    assert sixteen.calls == one.calls, (one.calls, sixteen.calls)
    assert sixteen.peak_bytes <= one.peak_bytes + 2048, (one.peak_bytes, sixteen.peak_bytes)
    assert model.engram_memory.stats().rows_host_cache > 0  # the device-counted hits, folded
    caches = [layer.host_cache for layer in model.engram_memory.source.tiers["disk"].layers.values()]
    index_bytes = sum(cache.device_bytes for cache in caches)
    assert index_bytes and model_bytes(model) >= index_bytes + sum(cache.storage.numel() for cache in caches)
    model.engram_memory.check_integrity()
