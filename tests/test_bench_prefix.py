"""bench.prefix --agentic on the tiny V4.1 checkpoint, at toy sizes (one server, the host and disk tiers
on): a line per tier configuration with every request counted and hits, and the sizes line."""

from __future__ import annotations

import json

from bench.prefix import main


def test_agentic_bench_counts_every_request_and_its_hits(checkpoints, capsys):
    main(["--agentic", "--sessions", "2", "--turns", "2", "--system-tokens", "64", "--answer-tokens", "2",
          "--tiers", "host+disk", "--gpu-points", "1", "--set", f"model.path={checkpoints['v41']}"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in rows] == ["prefix_agentic", "prefix_agentic_sizes"]
    run, sizes = rows
    assert run["tiers"] == "host+disk" and run["requests"] == 4
    assert 0 < run["cached_tokens"] <= run["reusable_rate"] * run["prompt_tokens"]
    assert run["computed_tokens"] == run["prompt_tokens"] - run["cached_tokens"]
    assert sum(run["hits_by_tier"].values()) == run["cached_tokens"]  # /metrics by tier add up to the usage's
    assert 0 < run["ttft_ms_p50"] <= run["ttft_ms_p99"]
    assert run["tier_points"]["gpu"] == 1 and run["tier_points"]["host"] > 0 and run["tier_points"]["disk"] > 0
    assert sizes["working_set_points"] == 2 and sizes["working_set_tokens"] > 0 and sizes["gpu_points"] == 1
