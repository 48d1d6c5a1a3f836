"""Logits equal transformers' DeepseekV4ForCausalLM (teacher-forced, float32) on tiny random configs."""

from __future__ import annotations

import pytest
import torch

from models import ForwardBatch, ModelCache, load_model
from tests.conftest import ORACLE_CONFIGS, ORACLE_SEQ_LEN, hf_logits, hf_model, random_tokens, relative_error

TOLERANCE = 1e-4


def full_forward(model, token_ids: list[int]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, 1, len(token_ids))
    return model(ForwardBatch.build([(0, token_ids, 0)], logits="all"), cache)


def indexer_gaps(reference, token_ids: list[int]) -> list[float]:
    """Relative gap between the k-th and (k+1)-th causal indexer scores of every CSA query that has
    more than k candidates: a zero gap would make the oracle's own top-k ambiguous."""
    captured = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
        for name, module in reference.named_modules()
        if name.endswith("indexer.scorer")
    ]
    hf_logits(reference, token_ids)
    for hook in hooks:
        hook.remove()
    config = reference.config
    rate, k = config.compress_rates["compressed_sparse_attention"], config.index_topk
    gaps = []
    for scores in captured:
        for t in range(scores.shape[0]):
            visible = scores[t, : (t + 1) // rate]
            if visible.numel() > k:
                top = visible.sort(descending=True).values
                gaps.append(((top[k - 1] - top[k]) / top[0].abs().clamp(min=1e-6)).item())
    return gaps


@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    checkpoint = checkpoints[name]
    ours, reference = load_model(checkpoint), hf_model(checkpoint)
    token_ids = random_tokens(ORACLE_SEQ_LEN[name], seed=11)
    config = ours.config
    assert len(token_ids) >= 4 * config.max_compress_rate
    assert len(token_ids) > config.sliding_window
    if "compressed_sparse_attention" in config.layer_types:
        assert len(token_ids) // 4 > config.index_topk, "top-k must actually select"
        gaps = indexer_gaps(reference, token_ids)
        assert gaps and min(gaps) > 1e-5, "the test input has (near) ties in the indexer top-k"
    expected = hf_logits(reference, token_ids)
    actual = full_forward(ours, token_ids)
    assert relative_error(actual, expected) <= TOLERANCE


def test_save_pretrained_directory_loads(checkpoints, tmp_path):
    """A directory written by transformers' save_pretrained serves with the same logits."""
    reference = hf_model(checkpoints["mixed"])
    reference.save_pretrained(tmp_path)
    token_ids = random_tokens(70, seed=5)
    assert relative_error(full_forward(load_model(tmp_path), token_ids), hf_logits(reference, token_ids)) <= TOLERANCE
