"""bench/slice.py dry-runs on the CPU with tiny dims: every command prints its JSON lines with positive
figures, and transformers' model runs on our very tensors (no speed is asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import slice as bench_slice
from models.tiny import tiny_config_dict

COMMON = ["--device", "cpu", "--dtype", "float32", "--copy-mib", "8", "--gemm-n", "64"]
CEILING_KEYS = {"slice.model": "active_bytes_per_token", "slice.copy": "bytes_per_s", "slice.matmul": "flops_per_s"}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("slice") / "config.json"
    path.write_text(json.dumps(tiny_config_dict(num_hidden_layers=4)))
    return str(path)


def run(capsys, config: str, *argv: str) -> dict[str, list[dict]]:
    bench_slice.main([*argv, "--config", config, "--layers", "3", *COMMON])
    rows: dict[str, list[dict]] = {}
    for line in capsys.readouterr().out.splitlines():
        row = json.loads(line)
        rows.setdefault(row["bench"], []).append(row)
    for bench, key in CEILING_KEYS.items():
        assert rows[bench][0][key] > 0
        assert rows[bench][0]["layers"] == 3
    return rows


def positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert row[key] > 0, (key, row)


def test_decode(capsys, config):
    rows = run(capsys, config, "decode", "--concurrency", "1", "3", "--context", "0", "40", "--steps", "2",
               "--modes", "default", "overlapped", "deterministic")["slice.decode"]
    assert [(r["mode"], r["context"], r["concurrency"]) for r in rows] == [
        (m, c, n) for m in ("default", "overlapped", "deterministic") for c in (0, 40) for n in (1, 3)
    ]
    for row in rows:
        positive(row, "step_ms_p50", "step_ms_p90", "tokens_per_s", "weight_bytes_per_step", "kv_bytes_per_step",
                 "bytes_per_step", "roofline_tokens_per_s", "ratio_to_roofline")


def test_families(capsys, config):
    """Every family of the slice is found and timed; its bytes are the weights it holds (the routed
    experts': only those the step touched, at most all of them)."""
    from bench.slice import build_slice, parse_args

    rows = run(capsys, config, "families", "--concurrency", "2", "--steps", "2", "--repeats", "2")["slice.family"]
    names = [r["family"] for r in rows]
    assert names == ["attention_projections", "hyper_connections", "router", "shared_expert", "routed_experts", "head",
                     "rest"]
    for row in rows[:-1]:
        positive(row, "modules", "us_per_step", "weight_bytes", "bytes_per_s", "ratio_to_copy", "share_of_step")
    _, model = build_slice(parse_args(["families", "--config", config, "--layers", "3", *COMMON]))
    by_name = {r["family"]: r for r in rows}
    assert by_name["head"]["weight_bytes"] == model.lm_head.weight.numel() * 4
    experts = sum(t.numel() * 4 for layer in model.model.layers for t in layer.mlp.experts.parameters())
    assert 0 < by_name["routed_experts"]["weight_bytes"] <= experts
    assert by_name["attention_projections"]["modules"] >= 3 * 4  # q_a, q_b, kv, o_a, o_b ... per layer


def test_ttft(capsys, config):
    rows = run(capsys, config, "ttft", "--prompt", "24", "70", "--prefill-chunk", "32", "--repeats", "1")["slice.ttft"]
    assert [r["prompt"] for r in rows] == [24, 70]
    for row in rows:
        positive(row, "ttft_ms_p50", "prefill_tokens_per_s", "prefill_flops", "flops_per_s", "ratio_to_matmul")


def test_ttft_sweeps_chunk_sizes(capsys, config):
    """Issue 24's chunk-size sweep: one row per (chunk size, prompt); the peak workspace is CUDA's
    allocator figure, None on the CPU."""
    rows = run(capsys, config, "ttft", "--prompt", "40", "--prefill-chunks", "16", "64", "--repeats", "1")["slice.ttft"]
    assert [(r["prefill_chunk"], r["prompt"]) for r in rows] == [(16, 40), (64, 40)]
    for row in rows:
        positive(row, "ttft_ms_p50", "prefill_tokens_per_s")
        assert row["peak_workspace_bytes"] is None  # the CPU keeps no allocator statistics


def test_transformers(capsys, config):
    pytest.importorskip("transformers")
    rows = run(capsys, config, "transformers", "--concurrency", "1", "2", "--prompt-len", "12", "--steps", "3",
               "--hf-experts", "eager")["slice.transformers"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        positive(row, "hf_ttft_ms", "hf_generate_tokens_per_s", "tokens_per_s", "roofline_tokens_per_s")
        # HF's decode rate is a difference of two generate times: on a shared CPU with 3 steps it is noise
        assert math.isfinite(row["hf_tokens_per_s"]) and math.isfinite(row["speedup_vs_hf"])


def test_transformers_shares_our_tensors_and_logits(config):
    pytest.importorskip("transformers")
    from bench.slice_hf import hf_sharing_weights
    from models import ForwardBatch, ModelCache

    args = bench_slice.parse_args(["transformers", "--config", config, "--layers", "3", *COMMON])
    raw, model = bench_slice.build_slice(args)
    hf = hf_sharing_weights(model, raw, "eager")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert hf.get_parameter(name).data_ptr() == model.get_parameter(name).data_ptr()
    tokens = torch.randint(3, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = ModelCache.allocate(model.config, 1, 32)
    ours = model(ForwardBatch.build([(0, tokens, 0)], logits="all"), cache)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-3


def test_decode_with_the_released_formats(capsys, config):
    """--weights released: MXFP4 experts and FP8 linears kept packed; a step reads fewer weight bytes."""
    argv = ("decode", "--concurrency", "2", "--context", "0", "--steps", "2")
    plain = run(capsys, config, *argv)["slice.decode"][0]
    released = run(capsys, config, *argv, "--weights", "released")
    row = released["slice.decode"][0]
    positive(row, "tokens_per_s", "weight_bytes_per_step", "roofline_tokens_per_s")
    assert row["weights"] == "released" and row["weight_bytes_per_step"] < plain["weight_bytes_per_step"]
    assert released["slice.model"][0]["param_bytes"] < 0.6 * run(capsys, config, "decode", "--concurrency", "1",
                                                                "--context", "0", "--steps", "1")["slice.model"][0]["param_bytes"]


def test_verify_reports_the_cost_of_each_draft_count_beside_the_plain_step(capsys, config):
    """bench.slice verify: one row per (concurrency, K), its step time and the ratio to the plain decode
    step measured in the same run (CPU: the numbers only need to be there and consistent)."""
    rows = run(capsys, config, "verify", "--concurrency", "1", "2", "--draft-tokens", "1", "3", "--steps", "2")
    verify = rows["slice.verify"]
    assert sorted((r["concurrency"], r["draft_tokens"]) for r in verify) == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for row in verify:
        positive(row, "step_ms_p50", "plain_step_ms_p50", "cost_ratio")
        assert row["cost_ratio"] == pytest.approx(row["step_ms_p50"] / row["plain_step_ms_p50"])
