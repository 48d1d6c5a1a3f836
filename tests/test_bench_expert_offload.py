"""bench/expert_offload.py dry-runs on the CPU with tiny dims: a line per (skew, concurrency) with the
offloaded and resident rates, the bytes each memory serves and the bound (no speed is asserted), and
the routing draws follow the asked skew."""

from __future__ import annotations

import json

import pytest
import torch

from bench import expert_offload
from models.tiny import tiny_config_dict

COMMON = ["--device", "cpu", "--dtype", "float32", "--copy-mib", "8", "--layers", "3"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "config.json"
    path.write_text(json.dumps(tiny_config_dict(num_hidden_layers=4)))
    return str(path)


def test_decode_lines(capsys, config):
    expert_offload.main(["--config", config, *COMMON, "--concurrency", "1", "3", "--steps", "3", "--resident", "2",
                         "--staging", "2", "--skew", "uniform", "zipf1.2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    decode = [r for r in rows if r["bench"] == "expert_offload.decode"]
    assert [(r["skew"], r["concurrency"]) for r in decode] == [(s, c) for s in ("uniform", "zipf1.2") for c in (1, 3)]
    for row in decode:
        assert row["layers"] == 3 and row["tokens_per_s"] > 0 and row["resident_tokens_per_s"] > 0
        assert row["device_bytes_per_step"] > 0 and row["host_bytes_per_step"] >= 0 and row["bound_step_ms"] > 0
        assert row["ratio_to_bound"] > 0
    assert all(r["host_bytes_per_step"] > 0 for r in decode if r["skew"] == "uniform")  # 6 host experts, 2 slots
    assert {r["bench"] for r in rows} >= {"slice.copy", "expert_offload.h2d"}


def test_zipf_routing_draws_the_asked_skew():
    """The hook's draws: under Zipf 1.2 the most chosen expert takes far more than its uniform share."""
    from models.config import ModelConfig
    from models.moe import Router

    model = torch.nn.Module()
    model.config = ModelConfig.from_dict(tiny_config_dict())
    model.router = Router(model.config, hashed=False)
    torch.nn.init.normal_(model.router.weight)
    x = torch.randn(400, model.config.hidden_size)
    shares = {}
    for skew in ("uniform", "zipf1.2"):
        with expert_offload.zipf_routing(model, expert_offload.SKEWS[skew], seed=0):
            _, ids = model.router(x, torch.zeros(400, dtype=torch.long))
        counts = torch.bincount(ids.flatten(), minlength=model.config.n_routed_experts).float()
        assert all(len(set(row)) == ids.shape[1] for row in ids.tolist())  # distinct experts a token
        shares[skew] = (counts.max() / counts.sum()).item()
    assert shares["zipf1.2"] > 1.5 * shares["uniform"]
