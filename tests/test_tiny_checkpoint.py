"""The tiny default checkpoint is deterministic; it is a V4.1 with Engram, and the V4 form still builds."""

import hashlib

from models import ModelConfig
from models.tiny import build_tiny_checkpoint


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_default_build_is_a_deterministic_v41_with_engram(tmp_path):
    first, second = build_tiny_checkpoint(tmp_path / "a"), build_tiny_checkpoint(tmp_path / "b")
    assert digest(first) == digest(second)
    config = ModelConfig.from_file(first / "config.json")
    assert config.is_v41 and len(config.engram.layer_ids) == 2
    assert set(config.compress_rates) == {0, 1, 2} and config.shared_compression.candidate_source is not None


def test_v4_build(tmp_path):
    config = ModelConfig.from_file(build_tiny_checkpoint(tmp_path / "v4", family="v4") / "config.json")
    assert not config.is_v41
    assert {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} <= set(config.layer_types)
    assert "hash_moe" in config.mlp_layer_types and config.hc_mult == 4
