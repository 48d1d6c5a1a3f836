"""bench.spec against the real server on a tiny V4.1 checkpoint with an MTP layer: plain decoding, then
the MTP proposer at a K, one JSON line per (configuration, concurrency), the acceptance figures those of
vLLM's counters and the speedup the ratio to plain decoding in the same run."""

from __future__ import annotations

import json

import pytest

from bench.spec import acceptance, held_out_prompts
from bench.spec import main as bench_spec
from models.tiny import build_tiny_checkpoint
from tests.serving import free_port


def test_spec_bench_prints_plain_and_each_k_with_acceptance(tmp_path, capsys):
    checkpoint = build_tiny_checkpoint(tmp_path / "v41-mtp", seed=6, family="v41", num_nextn_predict_layers=1)
    bench_spec(["--model", str(checkpoint), "--k", "2", "--concurrency", "1", "2", "--max-tokens", "12",
                "--prompt-chars", "200", "--server-args", "--log-level warning --max-model-len 512",
                "--port", str(free_port())])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["method"], r["k"], r["concurrency"]) for r in rows] == [
        ("plain", 0, 1), ("plain", 0, 2), ("mtp", 2, 1), ("mtp", 2, 2)]
    plain = {r["concurrency"]: r for r in rows if r["k"] == 0}
    for row in rows:
        assert row["generated"] == 12 * row["concurrency"] and row["commit"] is not None
        if row["k"] == 0:
            assert row["verify_steps"] == 0 and row["acceptance_length"] is None and row["speedup"] == 1.0
            continue
        steps = row["verify_steps"]
        assert steps > 0 and steps <= row["draft_tokens"] <= 2 * steps
        assert row["acceptance_length"] == 1 + row["accepted_tokens"] / steps
        assert len(row["accepted_per_position"]) <= 2
        assert sum(row["accepted_per_position"]) * steps == pytest.approx(row["accepted_tokens"])
        speed = row["decode_tokens_per_s"] or row["tokens_per_s"]
        base = plain[row["concurrency"]]
        assert row["speedup"] == pytest.approx(speed / (base["decode_tokens_per_s"] or base["tokens_per_s"]))


def test_acceptance_reads_counter_deltas():
    before = {"vllm:spec_decode_num_drafts": 3.0, "vllm:spec_decode_num_accepted_tokens": 1.0,
              "vllm:spec_decode_num_accepted_tokens_per_pos/0": 1.0}
    after = {"vllm:spec_decode_num_drafts": 7.0, "vllm:spec_decode_num_draft_tokens": 8.0,
             "vllm:spec_decode_num_accepted_tokens": 7.0, "vllm:spec_decode_num_accepted_tokens_per_pos/0": 5.0,
             "vllm:spec_decode_num_accepted_tokens_per_pos/1": 2.0}
    figures = acceptance(before, after)
    assert figures["acceptance_length"] == 1 + 6 / 4 and figures["accepted_per_position"] == [1.0, 0.5]


def test_the_prompts_are_held_out_text():
    prompts = held_out_prompts(3, 100)
    assert len(prompts) == 3 and all(len(p) == 100 for p in prompts) and len(set(prompts)) == 3
