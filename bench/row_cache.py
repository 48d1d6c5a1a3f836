"""The Engram row cache's replacement policy and bookkeeping cost on a Zipf trace (JSON lines out).

    python -m bench.row_cache [--rows 4000000] [--cache-share 0.1] [--zipf 1.1] [--steps 2000] [--per-step 64]

Each step asks for `--per-step` distinct rows drawn from a Zipf law (rank r has weight r ** -s) over
`--rows` rows, the way n-gram rows of text are hit: a small head over and over, a long tail once. Like
the store, a step looks its rows up (hits count, and are promoted) and inserts the misses. The first
quarter of the steps warms the cache and is not counted. Printed per policy: the hit rate, and the
microseconds of bookkeeping per looked-up row and per inserted row (row bytes are 8 here: the cost
measured is the index and the policy, not the copies). `lru` is a plain LRU written in this file as a
baseline; `row_cache` is engram_store.cache.RowCache, what the server runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from collections import OrderedDict

import numpy as np
import torch

from engram_store.cache import RowCache


class PlainLRU:
    """Least recently used, the baseline a scan-resistant policy must beat on Zipf traffic."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.order = capacity, OrderedDict()

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        hit = np.zeros(len(rows), dtype=bool)
        for i, row in enumerate(rows.tolist()):
            if row in self.order:
                self.order.move_to_end(row)
                hit[i] = True
        return hit

    def insert(self, rows: np.ndarray) -> None:
        for row in rows.tolist():
            self.order[row] = None
            if len(self.order) > self.capacity:
                self.order.popitem(last=False)


def zipf_steps(rows: int, s: float, steps: int, per_step: int, seed: int) -> list[np.ndarray]:
    """`steps` arrays of distinct row ids; which rows are frequent is a fixed random permutation."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -s
    cumulative = np.cumsum(weights / weights.sum())
    order = rng.permutation(rows)
    draws = np.searchsorted(cumulative, rng.random((steps, per_step)))
    return [np.unique(order[np.minimum(d, rows - 1)]) for d in draws]


def run(policy: str, trace: list[np.ndarray], capacity: int) -> dict:
    cache = PlainLRU(capacity) if policy == "lru" else RowCache(capacity, 8)
    warm = len(trace) // 4
    hits = looked = inserted = 0
    lookup_s = insert_s = 0.0
    for step, rows in enumerate(trace):
        began = time.perf_counter()
        hit = cache.lookup(rows) if policy == "lru" else cache.lookup(rows)[0]
        missing = rows[~hit]
        payload = None if policy == "lru" else torch.zeros(len(missing), 8, dtype=torch.uint8)
        middle = time.perf_counter()
        if policy == "lru":
            cache.insert(missing)
        else:
            cache.insert(missing, payload)
        ended = time.perf_counter()
        if step >= warm:
            hits += int(hit.sum())
            looked += len(rows)
            inserted += len(missing)
            lookup_s += middle - began
            insert_s += ended - middle
    return {"hit_rate": hits / looked, "lookup_us_per_row": 1e6 * lookup_s / looked,
            "insert_us_per_row": 1e6 * insert_s / max(1, inserted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--cache-share", type=float, default=0.1)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--per-step", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = zipf_steps(args.rows, args.zipf, args.steps, args.per_step, args.seed)
    capacity = int(args.rows * args.cache_share)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for policy in ("lru", "row_cache"):
        line = {"bench": "row_cache", "policy": policy, **run(policy, trace, capacity), "rows": args.rows,
                "capacity": capacity, "zipf": args.zipf, "steps": args.steps, "per_step": args.per_step,
                "machine": platform.processor() or platform.machine(), "commit": commit}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
