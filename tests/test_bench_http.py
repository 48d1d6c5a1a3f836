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
