"""bench.long_context on the tiny V4.1 checkpoint on the CPU: every cache's decode line, and check
lines that say the packed and host-tier caches picked the same top-k entries and gave the same
logits as the plain cache past a one-page ring."""

from __future__ import annotations

import json

from bench.long_context import main


def test_long_context_bench_checks_the_tier_against_the_plain_cache(checkpoints, capsys):
    main(["--config", str(checkpoints["v41"] / "config.json"), "--layers", "6", "--context", "200",
          "--concurrency", "1", "2", "--steps", "3", "--check-steps", "4", "--hot-tokens", "16",
          "--block-tokens", "16", "--prefill-chunk", "64", "--device", "cpu", "--dtype", "float32"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    decode = [r for r in rows if r["bench"] == "long_context.decode"]
    assert [(r["cache"], r["concurrency"]) for r in decode] == [
        (cache, c) for cache in ("plain", "packed", "tiered") for c in (1, 2)]
    tiered = [r for r in decode if r["cache"] == "tiered"]
    assert all(r["host_bytes_per_token"] > 0 and r["ring_pages_filled"] > 0 and r["tokens_per_s"] > 0 for r in tiered)
    packed = next(r for r in decode if r["cache"] == "packed")
    assert tiered[0]["device_bytes_per_token"] + tiered[0]["host_bytes_per_token"] == packed["device_bytes_per_token"]
    checks = [r for r in rows if r["bench"] == "long_context.check"]
    assert [r["cache"] for r in checks] == ["packed", "tiered"]
    for check in checks:
        assert check["topk_queries"] > 0 and check["topk_equal"] and check["logits_equal"] and check["tokens_equal"]
    prefills = [r for r in rows if r["bench"] == "long_context.prefill"]
    assert [r["cache"] for r in prefills] == ["plain", "packed", "tiered"]
    assert all(r["prefill_s"] > 0 and r["prefill_tokens_per_s"] == 200 / r["prefill_s"] for r in prefills)


def test_long_context_bench_runs_the_host_tier_alone(checkpoints, capsys):
    """`--caches tiered`: the long prompt's prefill and decode lines for the host tier only (what a
    context the plain cache cannot hold needs), no check lines."""
    main(["--config", str(checkpoints["v41"] / "config.json"), "--layers", "6", "--context", "120",
          "--concurrency", "1", "--steps", "2", "--check-steps", "1", "--hot-tokens", "16",
          "--block-tokens", "16", "--prefill-chunk", "64", "--device", "cpu", "--dtype", "float32",
          "--caches", "tiered"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["bench"], r["cache"]) for r in rows] == [("long_context.prefill", "tiered"), ("long_context.decode", "tiered")]
    assert "tokens_per_s_over_packed" not in rows[1] and rows[1]["host_bytes_per_token"] > 0
