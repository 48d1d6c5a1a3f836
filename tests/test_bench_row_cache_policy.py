"""bench.row_cache_policy: the Engram row caches' policy against LRU on Zipf traffic (issue 25 item 3)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.row_cache import zipf_steps
from bench.row_cache_policy import POLICIES, replay


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_serves_every_lookup_from_one_tier(policy):
    steps = zipf_steps(1000, 1.1, 90, 64, seed=1)
    shares = replay(policy, steps, device_rows=20, host_rows=200)
    assert sum(shares.values()) == pytest.approx(1.0) and all(0 <= v <= 1 for v in shares.values())
    assert shares["device_share"] > 0 and shares["disk_share"] > 0
    everything = replay(policy, steps, device_rows=20, host_rows=1000)  # the host cache holds the table
    seen_early = set(np.concatenate(steps[: len(steps) // 3]).tolist())
    if all(set(rows.tolist()) <= seen_early for rows in steps[len(steps) // 3 :]):
        assert everything["disk_share"] == 0
    else:
        assert everything["disk_share"] < shares["disk_share"]
