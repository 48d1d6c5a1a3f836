"""Shared fixtures: tiny checkpoints built on disk, and transformers' DeepseekV4 as the oracle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels then run on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from models.tiny import build_tiny_checkpoint  # noqa: E402  (after TRITON_INTERPRET: kernels read it on import)

# Three tiny configs that differ in layer types, hash layers, hc_mult, window, rope and key spelling.
ORACLE_CONFIGS = {
    # sliding + CSA + HCA, one hash layer, 4 streams, YaRN on the compressed rope (the default)
    "mixed": {},
    # CSA only, two hash layers, 2 streams, short window
    "csa": dict(
        num_hidden_layers=3,
        layer_types=["compressed_sparse_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        hc_mult=2,
        sliding_window=8,
        index_topk=3,
        index_n_heads=12,
    ),
    # the original release's keys: compress_ratios / num_hash_layers / qk_rope_head_dim, no hash
    # layers, 3 streams, long window, HCA rate 8, plain rope on the compressed branch
    "legacy": dict(
        num_hidden_layers=5,
        layer_types=None,
        compress_rates=None,
        mlp_layer_types=None,
        compress_ratios=[128, 0, 128, 4, 0],
        compress_rate_hca=8,
        num_hash_layers=0,
        partial_rotary_factor=None,
        qk_rope_head_dim=16,
        rope_parameters=None,
        hc_mult=3,
        sliding_window=32,
        index_topk=6,
    ),
}
ORACLE_SEQ_LEN = {"mixed": 100, "csa": 64, "legacy": 96}

# V4.1 checkpoints (no HF oracle exists for them in transformers 5.24; they are checked against the
# golden data and against themselves: cached vs one-shot, batched vs alone).
V41_CONFIGS = {
    # the default tiny model: ratio-2 and ratio-1 kv sources, a re-indexing layer, two-level top-k,
    # Engram on two layers with fp8 tables
    "v41": {},
    # the rules in their other corners: ratio 4, a kv source that is not an index source, a re-indexing
    # source, no candidate source, no Engram, head dims the fp8 / indexer fp4 blocks do not divide,
    # 2 streams, 3 experts per token without renormalisation, gate temperature, eps 1e-6
    "v41_variant": dict(
        num_hidden_layers=7,
        head_dim=48,
        compress_ratios=[0, 4, 4, 1, 2, 2, 0],
        kv_source_layer_ids=[1, 3, 4],
        index_source_layer_ids=[1, 2, 4],
        candidate_source_layer_id=-1,
        index_head_dim=24,
        index_topk=5,
        hc_mult=2,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        gate_temp=1.5,
        rms_norm_eps=1e-6,
        sliding_window=12,
        engram_layer_ids=None,
    ),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, overrides in ORACLE_CONFIGS.items():
        out[name] = build_tiny_checkpoint(root / name, seed=len(name), family="v4", **overrides)
    for name, overrides in V41_CONFIGS.items():
        out[name] = build_tiny_checkpoint(root / name, seed=len(name), family="v41", **overrides)
    return out


def hf_model(checkpoint: Path):
    """transformers' DeepseekV4ForCausalLM on the checkpoint's config and weights (float32, eager)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = json.loads((checkpoint / "config.json").read_text())
    config = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).eval()
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=True)
    return model


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def random_tokens(n: int, seed: int, low: int = 7, high: int = 512) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()
