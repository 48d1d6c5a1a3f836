"""bench.engram on a small table on the CPU: a line per tier with the keys issue 6 names, the warm
tier served from its cache, and the fetch-only figures per tier."""

from __future__ import annotations

import json

from bench.engram import main


def test_every_tier_reports_the_keys_the_issue_names(tmp_path, capsys):
    main(["--dir", str(tmp_path), "--table-gb", "0.01", "--runs", "1", "--steps", "2", "--prompt-len", "8",
          "--concurrency", "2", "--device", "cpu"])
    rows = {r["mode"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["gpu", "host", "disk_cold", "disk_warm"]
    for row in rows.values():
        assert row["concurrency"] == 2 and row["tok_s"] > 0
        assert {"prefetch_wait_p50_ms", "prefetch_wait_p99_ms", "hit_rate", "iops"} <= set(row)
    assert rows["disk_cold"]["iops"] > 0 and rows["disk_warm"]["hit_rate"] == 1.0
    assert rows["gpu"]["hit_rate"] is None


def test_fetch_only_times_each_tier_against_the_resident_one(tmp_path, capsys):
    main(["--dir", str(tmp_path), "--table-gb", "0.01", "--runs", "2", "--steps", "3", "--prompt-len", "8",
          "--concurrency", "1", "4", "--device", "cpu", "--fetch-only"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for c in (1, 4) for m in ("gpu", "host", "disk_cold", "disk_warm")]
    gpu_ms = {r["concurrency"]: r["fetch_ms"] for r in rows if r["mode"] == "gpu"}
    for row in rows:
        assert row["bench"] == "engram_fetch" and row["fetch_ms"] > 0
        assert abs(row["fetch_ms"] - row["extra_ms_vs_gpu"] - gpu_ms[row["concurrency"]]) < 1e-9
