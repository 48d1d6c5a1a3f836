"""The tiny default checkpoint is deterministic and serves as a V4 directory."""

import hashlib

from models import ModelConfig
from models.tiny import build_tiny_checkpoint


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_build_is_deterministic(tmp_path):
    first, second = build_tiny_checkpoint(tmp_path / "a"), build_tiny_checkpoint(tmp_path / "b")
    assert digest(first) == digest(second)
    config = ModelConfig.from_file(first / "config.json")
    assert {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} <= set(config.layer_types)
    assert "hash_moe" in config.mlp_layer_types and config.hc_mult == 4
