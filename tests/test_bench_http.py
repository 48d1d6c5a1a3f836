"""bench.http against the real server on the tiny V4.1 checkpoint: one JSON line per (prompt length,
concurrency), its token counts consistent with what was asked."""

from __future__ import annotations

import json

from bench.http import main as bench_http
from tests.serving import free_port


def test_http_bench_prints_a_line_per_concurrency(checkpoints, capsys):
    bench_http(["--server-args", f"--model {checkpoints['v41']} --log-level warning", "--port", str(free_port()),
                "--concurrency", "1", "3", "--prompt-len", "8", "--max-tokens", "5", "--vocab", "500"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["concurrency"], r["prompt_len"]) for r in rows] == [(1, 8), (3, 8)]
    for row in rows:
        assert row["generated"] == 5 * row["concurrency"]
        assert row["tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_max"] and row["itl_ms_p50"] > 0


def test_http_bench_arrivals_mode_compares_gaps_before_and_during_arrivals(checkpoints, capsys):
    """Issue 22 item 3's measurement: streams decode, prompts arrive; one `http.arrivals` line per
    concurrency with gaps counted in both windows and the ratio of the two."""
    bench_http(["--server-args", f"--model {checkpoints['v41']} --log-level warning", "--port", str(free_port()),
                "--concurrency", "2", "--max-tokens", "4000", "--vocab", "500", "--arrivals", "2",
                "--arrival-prompt-len", "96", "--arrival-interval-ms", "50", "--pure-s", "0.5"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["bench"], r["concurrency"], r["arrivals"]) for r in rows] == [("http.arrivals", 2, 2)]
    row = rows[0]
    assert min(row["gaps"]) >= 2
    assert 0 < row["itl_ms_p50_pure"] <= row["itl_ms_p90_pure"]
    assert 0 < row["itl_ms_p50_arrivals"] <= row["itl_ms_p90_arrivals"] <= row["itl_ms_max_arrivals"]
    assert row["p90_over_pure_p50"] == row["itl_ms_p90_arrivals"] / row["itl_ms_p50_pure"]
    assert 0 < row["itl_ms_mean_pure"] < float("inf") and 0 < row["itl_ms_mean_arrivals"] < float("inf")
    assert row["mean_over_pure_mean"] == row["itl_ms_mean_arrivals"] / row["itl_ms_mean_pure"]
    assert row["arrival_ttft_ms_p50"] > 0


def test_http_bench_samples_as_asked(checkpoints, capsys):
    """--temperature / --top-p reach every request (a chat client's default sampling, not greedy): the
    row names them and the streams still give every token asked for."""
    bench_http(["--server-args", f"--model {checkpoints['v41']} --log-level warning", "--port", str(free_port()),
                "--concurrency", "2", "--prompt-len", "8", "--max-tokens", "6", "--vocab", "500", "--api", "chat",
                "--temperature", "1.0", "--top-p", "0.9"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["api"], r["temperature"], r["top_p"], r["generated"]) for r in rows] == [("chat", 1.0, 0.9, 12)]
