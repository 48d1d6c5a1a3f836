"""The Engram row caches' replacement policy against LRU on Zipf traffic (issue 25 item 3), on the CPU.

    python -m bench.row_cache_policy [--rows 2000000] [--steps 3000] [--batch 16] [--columns 16]
                                     [--zipf 1.0 1.1 1.2] [--device-pct 0.5] [--host-pct 5]

A disk-resident table sits under two inclusive row caches, as engram_store/store.py builds them: a
device cache (`engram.gpu_cache_gb`) above a host cache (`engram.host_cache_gb`). Each step looks up the
distinct rows of `batch` sequences x `columns` row ids, drawn from a Zipf law over the table's rows
(rank r with probability ~ r^-s, ranks scattered over the row ids): the device cache first, then the
host cache, the rest read from disk and inserted into both (what DiskLayer does). Per policy, the share
of row lookups served by each tier (over the steps after the first third, once the caches are warm):
- `clock`: the project's RowCache (CLOCK with up to 3 credits a slot, engram_store/cache.py) in both;
- `lru`: least recently used in both (bench/row_cache.py's PlainLRU, the single cache's baseline there);
- `clock_promote`: clock, and a host hit is also inserted into the device cache (the store does not
  do this: a row read from disk long ago that is still hot lives only in the host cache).
bench/row_cache.py measures one cache's hit rate and bookkeeping cost; this one the two tiers together.
One JSON line per (zipf, policy). The row ids stand in for n-gram hashes of Zipf tokens: an Engram
row's popularity is its n-gram's, itself close to Zipf (bench/engram.py runs the real hashing).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.row_cache import PlainLRU, zipf_steps
from engram_store.cache import RowCache

ROW_BYTES = 8  # the policy ignores the payload: the smallest row keeps the caches' storage small
POLICIES = ("clock", "lru", "clock_promote")


class ClockTier:
    """The project's RowCache, through the same two calls."""

    def __init__(self, capacity: int) -> None:
        self.cache = RowCache(capacity, ROW_BYTES)

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        return self.cache.lookup(rows)[0]

    def insert(self, rows: np.ndarray) -> None:
        self.cache.insert(rows, torch.zeros(len(rows), ROW_BYTES, dtype=torch.uint8))


def replay(policy: str, steps: list[np.ndarray], device_rows: int, host_rows: int) -> dict[str, float]:
    """Lookups served by each tier over the warm steps (the last two thirds)."""
    tier = PlainLRU if policy == "lru" else ClockTier
    device, host = tier(device_rows), tier(host_rows)
    served = {"device": 0, "host": 0, "disk": 0}
    warm_from = len(steps) // 3
    for index, rows in enumerate(steps):
        on_device = device.lookup(rows)
        rest = rows[~on_device]
        on_host = host.lookup(rest)
        missing = rest[~on_host]
        host.insert(missing)
        device.insert(missing if policy != "clock_promote" else rest)
        if index >= warm_from:
            served["device"] += int(on_device.sum())
            served["host"] += int(on_host.sum())
            served["disk"] += len(missing)
    total = sum(served.values())
    return {f"{tier}_share": count / total for tier, count in served.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the table")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16, help="sequences a step")
    parser.add_argument("--columns", type=int, default=16, help="row ids a sequence looks up a step")
    parser.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.1, 1.2])
    parser.add_argument("--device-pct", type=float, default=0.5, help="device cache, % of the table's rows")
    parser.add_argument("--host-pct", type=float, default=5.0, help="host cache, % of the table's rows")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device_rows, host_rows = int(args.rows * args.device_pct / 100), int(args.rows * args.host_pct / 100)
    for s in args.zipf:
        steps = zipf_steps(args.rows, s, args.steps, args.batch * args.columns, args.seed)
        for policy in args.policies:
            shares = replay(policy, steps, device_rows, host_rows)
            print(json.dumps({"bench": "row_cache_policy", "zipf": s, "policy": policy, "rows": args.rows,
                              "device_rows": device_rows, "host_rows": host_rows, "steps": args.steps,
                              "lookups_per_step": args.batch * args.columns,
                              **{k: round(v, 4) for k, v in shares.items()}}), flush=True)


if __name__ == "__main__":
    main()
