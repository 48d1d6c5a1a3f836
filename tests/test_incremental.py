"""Incremental decode and mixed batches give the full forward's logits (caller-owned state)."""

from __future__ import annotations

import random

import pytest
import torch

from models import ForwardBatch, ModelCache, load_model
from tests.conftest import random_tokens, relative_error

TOLERANCE = 1e-4


def solo_logits(model, token_ids: list[int]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, 1, len(token_ids))
    return model(ForwardBatch.build([(0, token_ids, 0)], logits="all"), cache)


@pytest.mark.parametrize("name", ["mixed", "csa", "legacy"])
def test_prefill_then_decode_matches_full_forward(checkpoints, name):
    model = load_model(checkpoints[name])
    token_ids = random_tokens(90, seed=3)
    full = solo_logits(model, token_ids)
    # prefill lengths on both sides of window and compression-rate boundaries
    for prefill in (1, 3, 4, 7, 8, 16, 17, 40):
        cache = ModelCache.allocate(model.config, 2, 128)
        slot = 1  # not slot 0: slots are independent
        pieces = [model(ForwardBatch.build([(slot, token_ids[:prefill], 0)], logits="all"), cache)]
        for position in range(prefill, len(token_ids)):
            pieces.append(model(ForwardBatch.build([(slot, [token_ids[position]], position)], logits="all"), cache))
        assert relative_error(torch.cat(pieces), full) <= TOLERANCE, f"prefill {prefill}"


def test_batch_of_sequences_matches_each_solo(checkpoints):
    """Chunked prefills and decodes of several sequences share steps; each sees only its own state."""
    model = load_model(checkpoints["mixed"])
    sequences = {0: random_tokens(37, 1), 1: random_tokens(80, 2), 2: random_tokens(20, 3), 3: random_tokens(65, 4)}
    expected = {slot: solo_logits(model, ids) for slot, ids in sequences.items()}
    cache = ModelCache.allocate(model.config, 4, 128)
    done = {slot: 0 for slot in sequences}
    got: dict[int, list[torch.Tensor]] = {slot: [] for slot in sequences}
    rng = random.Random(0)
    while any(done[s] < len(ids) for s, ids in sequences.items()):
        step = []
        for slot, ids in sequences.items():
            if done[slot] < len(ids) and rng.random() < 0.8:
                n = rng.choice([1, 1, 2, 5, 13])
                step.append((slot, ids[done[slot] : done[slot] + n], done[slot]))
        if not step:
            continue
        logits = model(ForwardBatch.build(step, logits="all"), cache)
        offset = 0
        for slot, tokens, _ in step:
            got[slot].append(logits[offset : offset + len(tokens)])
            offset += len(tokens)
            done[slot] += len(tokens)
    for slot in sequences:
        assert relative_error(torch.cat(got[slot]), expected[slot]) <= TOLERANCE, f"sequence {slot}"


def test_slot_reuse_needs_no_reset(checkpoints):
    """A slot freed by one sequence and taken by another gives the newcomer its solo logits."""
    model = load_model(checkpoints["mixed"])
    cache = ModelCache.allocate(model.config, 1, 128)
    model(ForwardBatch.build([(0, random_tokens(90, 8), 0)], logits="last"), cache)
    newcomer = random_tokens(50, 9)
    reused = model(ForwardBatch.build([(0, newcomer, 0)], logits="all"), cache)
    assert relative_error(reused, solo_logits(model, newcomer)) <= TOLERANCE
