"""The V4.1 model on the tiny checkpoints: the cached serving forward (chunked prefill, decode, several
sequences in one step) reproduces the one-shot forward, and bad checkpoints fail with named errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models import CheckpointError, ConfigError, ForwardBatch, ModelCache, ModelConfig, load_model
from tests.conftest import random_tokens

V41 = ["v41", "v41_variant"]


def one_shot(model, ids: list[int]) -> torch.Tensor:
    return model(ForwardBatch.build([(0, ids, 0)], logits="all"), ModelCache.allocate(model.config, 1, 256))


@pytest.mark.parametrize("name", V41)
@pytest.mark.parametrize("chunks", [[1] * 9 + [60, 11], [17, 23, 40], [5, 3, 7, 13, 52]])
def test_chunked_prefill_and_decode_equal_one_shot(checkpoints, name, chunks):
    """Without the simulated rounding no top-k can flip, so every position agrees to float noise."""
    model = load_model(checkpoints[name], simulate_quantization=False)
    ids = random_tokens(sum(chunks), seed=len(chunks))
    cache = ModelCache.allocate(model.config, 2, 256)
    pieces, start = [], 0
    for length in chunks:
        pieces.append(model(ForwardBatch.build([(1, ids[start : start + length], start)], logits="all"), cache))
        start += length
    torch.testing.assert_close(torch.cat(pieces), one_shot(model, ids), rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", V41)
def test_with_simulated_quantization_decode_agrees_with_one_shot(checkpoints, name):
    """With the rounding on, an isolated position may flip (the golden README's caveat); the
    prompt log-probabilities must still agree closely and greedy choices everywhere but flips."""
    model = load_model(checkpoints[name])
    ids = random_tokens(90, seed=11)
    cache = ModelCache.allocate(model.config, 1, 256)
    prefill = model(ForwardBatch.build([(0, ids[:50], 0)], logits="all"), cache)
    decoded = [model(ForwardBatch.build([(0, [t], 50 + i)]), cache) for i, t in enumerate(ids[50:])]
    cached = torch.cat([prefill, *decoded])
    full = one_shot(model, ids)
    targets = torch.tensor(ids[1:])[:, None]
    deviation = (cached[:-1].log_softmax(-1).gather(1, targets) - full[:-1].log_softmax(-1).gather(1, targets)).abs()
    assert deviation.median() <= 1e-4 and deviation.quantile(0.95) <= 1e-2
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("name", V41)
def test_batched_step_equals_sequences_alone(checkpoints, name):
    model = load_model(checkpoints[name], simulate_quantization=False)
    prompts = [random_tokens(n, seed=n) for n in (37, 64, 21)]
    alone = torch.stack([one_shot(model, p)[-1] for p in prompts])
    cache = ModelCache.allocate(model.config, 4, 256)
    model(ForwardBatch.build([(3, prompts[1][:-1], 0), (0, prompts[2][:-5], 0)]), cache)
    batched = model(ForwardBatch.build([
        (0, prompts[2][-5:], len(prompts[2]) - 5), (2, prompts[0], 0), (3, prompts[1][-1:], len(prompts[1]) - 1),
    ]), cache)
    torch.testing.assert_close(batched, alone[[2, 0, 1]], rtol=0, atol=2e-5)


def copy_checkpoint(source, target, **config_changes):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_engram_vocab_size_must_match_the_tokenizer(checkpoints, tmp_path):
    actual = json.loads((checkpoints["v41"] / "config.json").read_text())["engram_compressed_vocab_size"]
    broken = copy_checkpoint(checkpoints["v41"], tmp_path / "bad", engram_compressed_vocab_size=actual + 1)
    with pytest.raises(CheckpointError, match=f"engram_compressed_vocab_size is {actual + 1}.*compresses to {actual}"):
        load_model(broken)


def test_engram_table_rows_must_match_the_layout(checkpoints, tmp_path):
    broken = copy_checkpoint(checkpoints["v41"], tmp_path / "bad", engram_vocab_size=3000, engram_num_embeddings=None)
    with pytest.raises(CheckpointError, match=r"model\.engram_tables\.1\.weight has \d+ rows, the layout needs"):
        load_model(broken)


def test_engram_needs_the_tokenizer(checkpoints, tmp_path):
    broken = copy_checkpoint(checkpoints["v41"], tmp_path / "bad")
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_model(broken)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(index_source_layer_ids=[0, 1]), r"index_source_layer_ids \[0\]"),
        (dict(kv_source_layer_ids=[3], index_source_layer_ids=[3]), r"layers \[1, 2\] compress but no kv_source"),
        (dict(candidate_source_layer_id=2), "candidate_source_layer_id 2 is not an index source"),
        (dict(engram_layer_ids=[1, 9]), r"engram_layer_ids \[1, 9\]"),
        (dict(compress_ratios=[0, 2]), "compress_ratios must give 6"),
    ],
)
def test_bad_v41_configs_name_the_key(checkpoints, changes, message):
    raw = {**json.loads((checkpoints["v41"] / "config.json").read_text()), **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_composite_config_reads_its_text_config(checkpoints):
    text = json.loads((checkpoints["v41"] / "config.json").read_text())
    composite = {"model_type": "deepseek_v41", "eos_token_id": 1, "text_config": {**text, "model_type": "deepseek_v41_text"}}
    assert ModelConfig.from_dict(composite).shared_compression == ModelConfig.from_dict(text).shared_compression
