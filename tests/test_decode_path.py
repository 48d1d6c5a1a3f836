"""The decode path (one token per sequence, tensors only, what CUDA graphs capture) against the
chunked forward on the same model and state: float32 logits agree to float-sum order, on CPU.

The sequences decode past the sliding window, through CSA groups (rate 4) whose indexer must pick 4
of more entries, and past an HCA group (rate 16), from different positions in one batch, with
block tables wider than they need (what a graph's fixed width gives) and pages out of order."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import experts_grouped, experts_reference
from models import DecodeBatch, ForwardBatch, ModelCache, ModelConfig
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens

BLOCK = 16
WIDTH = 8  # pages in every block table: 128 tokens


def build(seed: int = 0, **overrides):
    config = ModelConfig.from_dict(tiny_config_dict(**overrides))
    return build_random_model(config, torch.float32, "cpu", seed)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp4"])
def test_decode_equals_forward_over_many_steps(kv_cache_dtype):
    """fp4: both paths over packed pages (index keys 32 wide, a whole scale block)."""
    torch.manual_seed(0)
    model = build(index_head_dim=32)
    starts = [0, 5, 23, 40]  # prompt lengths: the first decodes from an empty slot
    pages = {slot: [17 - 4 * slot - i for i in range(4)] for slot in range(4)}  # 4 pages, descending
    caches = [ModelCache.allocate(model.config, 4, 64, num_pages=18, block_tokens=BLOCK, kv_cache_dtype=kv_cache_dtype)
              for _ in range(2)]
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate(starts)]
    for cache in caches:
        rows = [(slot, prompt, 0, pages[slot]) for slot, prompt in enumerate(prompts) if prompt]
        model(ForwardBatch.build(rows), cache)
    eager, graphable = caches
    positions = list(starts)
    for step in range(24):
        tokens = random_tokens(4, seed=100 + step)
        expected = model(ForwardBatch.build([(s, [tokens[s]], positions[s], pages[s]) for s in range(4)]), eager)
        batch = DecodeBatch.build([(s, tokens[s], positions[s], pages[s]) for s in range(4)], width=WIDTH)
        actual = model.decode(batch, graphable)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        positions = [p + 1 for p in positions]
    for expect, got in zip(eager.tensors(), graphable.tensors()):
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)


def test_decode_rows_do_not_depend_on_their_neighbours():
    """A row's logits are the same alone or beside a padding row that writes a scratch slot / page."""
    model = build(1)
    cache = ModelCache.allocate(model.config, 3, 64, num_pages=12, block_tokens=BLOCK)
    prompt = random_tokens(30, seed=3)
    model(ForwardBatch.build([(0, prompt, 0, [0, 1, 2, 3])]), cache)
    cache.copy_slots([0], [1])
    cache.copy_pages([0, 1, 2, 3], [4, 5, 6, 7])
    alone = model.decode(DecodeBatch.build([(0, 9, 30, [0, 1, 2, 3])], width=WIDTH), cache)
    padded = model.decode(DecodeBatch.build([(1, 9, 30, [4, 5, 6, 7]), (2, 0, 0, [11])], width=WIDTH), cache)
    torch.testing.assert_close(padded[:1], alone, rtol=1e-5, atol=1e-5)


def test_grouped_experts_equal_the_reference_loop():
    """The capturable grouped-GEMM path (CPU fallback here, CUTLASS on the GPU: tests/test_gpu.py)
    against the loop, with a rank's run of experts [2, 6) so other ranks' choices contribute zero."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=generator)
    experts = torch.randint(0, 8, (7, 3), generator=generator)
    weights = torch.rand(7, 3, generator=generator)
    gate_up, down = torch.randn(4, 48, 32, generator=generator), torch.randn(4, 32, 24, generator=generator)
    for before_down in (False, True):
        args = (x, weights, experts, gate_up, down, 2, 7.0, before_down)
        torch.testing.assert_close(experts_grouped(*args), experts_reference(*args), rtol=1e-5, atol=1e-5)


def decode_against_forward(model, steps: int, rtol: float) -> list[float]:
    """Both paths over the same prompts and fed tokens, each on its own cache; returns per-step max
    relative error, asserting every step within `rtol` (None: only collect)."""
    starts = [0, 5, 23, 40]
    pages = {slot: [17 - 4 * slot - i for i in range(4)] for slot in range(4)}
    caches = [ModelCache.allocate(model.config, 4, 64, num_pages=18, block_tokens=BLOCK) for _ in range(2)]
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate(starts)]
    for cache in caches:
        model(ForwardBatch.build([(slot, prompt, 0, pages[slot]) for slot, prompt in enumerate(prompts) if prompt]), cache)
    eager, graphable = caches
    positions, errors = list(starts), []
    for step in range(steps):
        tokens = random_tokens(4, seed=100 + step)
        expected = model(ForwardBatch.build([(s, [tokens[s]], positions[s], pages[s]) for s in range(4)]), eager)
        rows = model.engram_rows(list(range(4)), tokens, positions, graphable)
        actual = model.decode(DecodeBatch.build([(s, tokens[s], positions[s], pages[s]) for s in range(4)], width=WIDTH), graphable, rows)
        errors.append(((actual - expected).abs().max() / expected.abs().max()).item())
        if rtol is not None:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol, msg=f"step {step}")
        positions = [p + 1 for p in positions]
    return errors


def test_v41_decode_equals_forward_over_many_steps(checkpoints):
    """V4.1 with Engram, shared kv / index sources and candidate blocks, quantization simulation off:
    the same numbers up to float-sum order at every step, past the window and many groups."""
    from models import load_model

    decode_against_forward(load_model(checkpoints["v41"], simulate_quantization=False), steps=24, rtol=1e-4)


def test_v41_decode_with_simulated_quantization_tracks_the_forward(checkpoints):
    """With V4.1's fp8 / fp4 rounding on, a float-order difference can move a value across a rounding
    boundary (golden README): nearly every step still agrees to 1e-4, and none drifts far."""
    from models import load_model

    errors = decode_against_forward(load_model(checkpoints["v41"]), steps=24, rtol=None)
    assert sum(e < 1e-4 for e in errors) >= 20, errors
    assert max(errors) < 0.05, errors


def test_engram_step_row_ids_equal_the_per_chunk_hashing(checkpoints):
    """The vectorised decode-step hashing against the chunked one: the same row ids and look-backs,
    for sequences mid-stream, just started (position 0 clears what the slot held), and past a dead id."""
    from models import load_model

    model = load_model(checkpoints["v41"])
    memory = model.engram_memory
    cache = ModelCache.allocate(model.config, 4, 64)
    model(ForwardBatch.build([(0, random_tokens(5, seed=1), 0), (1, random_tokens(1, seed=2), 0),
                              (2, random_tokens(9, seed=3), 0), (3, random_tokens(7, seed=4), 0)]), cache)
    context = cache.engram_context
    context[2, 0] = -1  # a dead id inside the look-back
    slots, tokens, positions = [0, 1, 2, 3], random_tokens(4, seed=5), [5, 1, 9, 0]
    by_chunk = context.clone()
    expected = memory.row_ids(ForwardBatch.build([(s, [t], p) for s, t, p in zip(slots, tokens, positions)]), by_chunk)
    assert torch.equal(memory.step_row_ids(slots, tokens, positions, context), expected)
    assert torch.equal(context, by_chunk)


def test_graph_buckets_cover_every_batch_and_table():
    from worker.cuda_graphs import batch_buckets, width_buckets

    assert batch_buckets(1) == [1] and batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert width_buckets(66, 128) == [32, 66]  # 4,096 tokens, then the whole 8,448-token table
    assert width_buckets(8192, 128) == [32, 128, 512, 2048, 8192]
    assert width_buckets(4, 128) == [4]  # a table shorter than the first bucket
