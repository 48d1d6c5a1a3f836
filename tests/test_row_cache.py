"""The Engram row cache: every cached row reads back its own bytes under churn, and its policy keeps a
hot head through a burst of one-off rows (what plain LRU loses)."""

from __future__ import annotations

import numpy as np
import torch

from bench.row_cache import PlainLRU, run, zipf_steps
from engram_store.cache import FREE, MAX_CREDIT, RowCache


def payload(rows: np.ndarray) -> torch.Tensor:
    """Bytes that name their row: 8 little-endian bytes of the row id."""
    return torch.from_numpy(rows.astype("<i8").view(np.uint8).reshape(len(rows), 8).copy())


def check_consistent(cache: RowCache) -> None:
    slots = np.fromiter(cache.index.values(), dtype=np.int64, count=len(cache.index))
    rows = np.fromiter(cache.index.keys(), dtype=np.int64, count=len(cache.index))
    assert len(np.unique(slots)) == len(slots) <= cache.capacity, "two rows share a slot"
    assert (cache.row_of_slot[slots] == rows).all()
    assert (cache.row_of_slot != FREE).sum() == len(rows)
    assert torch.equal(cache.storage[torch.from_numpy(slots)], payload(rows)), "a slot holds another row's bytes"


def test_rows_read_back_their_own_bytes_under_random_churn():
    rng = np.random.default_rng(0)
    cache = RowCache(257, 8)
    looked = hits = 0
    for _ in range(400):
        rows = np.unique(rng.integers(0, 2000, size=rng.integers(1, 400)))
        hit, slots = cache.lookup(rows)
        looked, hits = looked + len(rows), hits + int(hit.sum())
        assert torch.equal(cache.storage[torch.from_numpy(slots)], payload(rows[hit]))
        assert (cache.absent(rows) == ~hit).all()
        cache.insert(rows[~hit], payload(rows[~hit]))
        check_consistent(cache)
    assert len(cache) == cache.capacity
    assert (cache.hits, cache.misses) == (hits, looked - hits) and hits > 0


def test_a_hot_head_survives_a_burst_of_one_off_rows_that_flushes_plain_lru():
    head = np.arange(20)
    cache, lru = RowCache(100, 8), PlainLRU(100)
    cache.insert(head, payload(head))
    lru.insert(head)
    for _ in range(MAX_CREDIT):
        assert cache.lookup(head)[0].all() and lru.lookup(head).all()
    burst = np.arange(1000, 1150)  # one-off rows, more than the cache holds
    for start in range(0, len(burst), 10):
        batch = burst[start : start + 10]
        cache.insert(batch, payload(batch))
        lru.insert(batch)
    assert not cache.absent(head).any(), "the head was evicted by rows seen once"
    assert lru.lookup(head).sum() == 0  # the baseline loses it
    check_consistent(cache)


def test_rows_without_hits_leave_before_rows_with_hits():
    cache = RowCache(8, 8)
    rows = np.arange(8)
    cache.insert(rows, payload(rows))
    cache.lookup(rows[::2])  # even rows earn a credit
    cache.insert(np.array([100, 101, 102, 103]), payload(np.array([100, 101, 102, 103])))
    assert not cache.absent(rows[::2]).any() and cache.absent(rows[1::2]).all()
    check_consistent(cache)


def test_an_insert_larger_than_the_cache_keeps_its_last_rows():
    cache = RowCache(16, 8)
    rows = np.arange(40)
    cache.insert(rows, payload(rows))
    assert not cache.absent(rows[-16:]).any() and cache.absent(rows[:-16]).all()
    check_consistent(cache)


def test_on_a_zipf_trace_the_policy_beats_plain_lru():
    trace = zipf_steps(rows=50_000, s=1.1, steps=3000, per_step=64, seed=1)
    ours, lru = run("row_cache", trace, 5_000), run("lru", trace, 5_000)
    assert ours["hit_rate"] > lru["hit_rate"] + 0.005, (ours, lru)


def test_rows_read_twice_are_cached_once():
    """A hint's read and a step's read of the same rows can both finish and both insert."""
    cache = RowCache(6, 8)
    rows = np.array([1, 2, 3])
    cache.insert(rows, payload(rows))
    cache.insert(np.array([3, 4, 2]), payload(np.array([3, 4, 2])))
    assert len(cache) == 4
    check_consistent(cache)
    for new in range(10, 30, 3):  # evicting every slot the repeats could have left behind
        batch = np.arange(new, new + 3)
        cache.insert(batch, payload(batch))
        check_consistent(cache)
