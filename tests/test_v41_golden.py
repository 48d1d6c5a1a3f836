"""DeepSeek-V4.1 against shared/golden/deepseek_v41 (outputs of the HF reference run on its checkpoint).

Tolerances are the golden README's: greedy tokens, Engram hash ids, indexer top-k sets and the candidate
mask exactly; prompt logprobs within a median deviation of 1e-3 and a 95th percentile of 1e-2, because the
simulated fp8/fp4 rounding feeds hard top-k choices and a 1e-7 difference can flip an isolated position.
With the simulation off, nothing can flip and logits must agree to 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import ForwardBatch, ModelCache, load_model
from models.attention_v41 import SelectionTrace

GOLDEN = Path(__file__).resolve().parent.parent.parent / "shared" / "golden" / "deepseek_v41"
pytestmark = pytest.mark.skipif(not GOLDEN.exists(), reason=f"golden data folder {GOLDEN} is absent")
SEQUENCES = ["seq0", "seq1", "seq2"]


@pytest.fixture(scope="module")
def golden():
    torch.set_num_threads(1)  # bit-stable CPU reductions
    inputs = json.loads((GOLDEN / "golden_inputs_and_generation.json").read_text())
    return inputs, load_file(GOLDEN / "golden_outputs.safetensors")


@pytest.fixture(scope="module")
def model():
    return load_model(GOLDEN)


def prompt_logprob_deviation(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """|log p(next token)| differences at every prompt position that has a next token."""
    targets = torch.tensor(ids[1:])
    ours = logits[:-1].log_softmax(-1).gather(1, targets[:, None])
    theirs = reference[:-1].log_softmax(-1).gather(1, targets[:, None])
    return (ours - theirs).abs().flatten()


def full_forward(model, ids: list[int], trace: SelectionTrace | None = None) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, 1, 128)
    return model(ForwardBatch.build([(0, ids, 0)], logits="all"), cache, trace)


def nonnegative_sets(ids: torch.Tensor | None, n: int) -> list[set[int]]:
    if ids is None:
        return [set() for _ in range(n)]
    return [{i for i in row.tolist() if i >= 0} for row in ids]


@pytest.mark.parametrize("name", SEQUENCES)
def test_full_forward_matches_reference(model, golden, name):
    inputs, outputs = golden
    ids = inputs["sequences"][name]["input_ids"]
    trace = SelectionTrace()
    logits = full_forward(model, ids, trace)
    deviation = prompt_logprob_deviation(logits, outputs[f"{name}_logits"], ids)
    assert deviation.median() <= 1e-3 and deviation.quantile(0.95) <= 1e-2, deviation
    assert torch.equal(trace.engram_row_ids[0], outputs[f"{name}_engram_hash_ids"])
    for layer in (2, 4, 5):
        expected = outputs[f"{name}_layer{layer}_indexer_topk_idx_sorted"]
        assert nonnegative_sets(trace.topk[layer][0], len(ids)) == nonnegative_sets(expected, len(ids)), layer
    assert torch.equal(trace.candidates[4][0], outputs[f"{name}_layer4_candidate_mask"].bool())


@pytest.mark.parametrize("name", SEQUENCES)
def test_without_simulated_quantization_logits_match_to_1e5(golden, name):
    inputs, outputs = golden
    model = load_model(GOLDEN, simulate_quantization=False)
    ids = inputs["sequences"][name]["input_ids"]
    logits = full_forward(model, ids)
    torch.testing.assert_close(logits, outputs[f"{name}_logits_debug_no_fake_quant"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", SEQUENCES)
def test_prefill_then_decode_greedy_tokens_and_hash_ids(model, golden, name):
    """Prefill the prompt, then decode 11 single tokens from the cache: the reference's greedy tokens;
    the Engram ids hashed one token at a time equal hashing the whole sequence in one forward."""
    inputs, outputs = golden
    sequence = inputs["sequences"][name]
    ids = sequence["input_ids"]
    cache = ModelCache.allocate(model.config, 3, 128)
    trace = SelectionTrace()
    slot = 2  # not slot 0: the slot index must not matter
    logits = model(ForwardBatch.build([(slot, ids, 0)]), cache, trace)
    generated, step_logits = [], []
    for step in range(len(sequence["greedy_new_tokens"])):
        step_logits.append(logits[0])
        generated.append(int(logits[0].argmax()))
        logits = model(ForwardBatch.build([(slot, [generated[-1]], len(ids) + step)]), cache, trace)
    assert generated == sequence["greedy_new_tokens"] == sequence["greedy_new_tokens_full_forward"]
    torch.testing.assert_close(torch.stack(step_logits), outputs[f"{name}_greedy_cached_step_logits"], rtol=0, atol=1e-4)
    incremental = torch.cat(trace.engram_row_ids)
    whole = full_forward_row_ids(model, ids + generated)
    assert torch.equal(incremental, whole)
    assert torch.equal(incremental[: len(ids)], outputs[f"{name}_engram_hash_ids"])


def full_forward_row_ids(model, ids: list[int]) -> torch.Tensor:
    trace = SelectionTrace()
    full_forward(model, ids, trace)
    return trace.engram_row_ids[0]


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_full_forward(golden, chunk):
    """Simulation off (no rounding flips possible): chunked prefill through the cache reproduces the
    one-shot forward at every position."""
    inputs, outputs = golden
    model = load_model(GOLDEN, simulate_quantization=False)
    ids = inputs["sequences"]["seq2"]["input_ids"]
    cache = ModelCache.allocate(model.config, 1, 128)
    pieces = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        pieces.append(model(ForwardBatch.build([(0, piece, start)], logits="all"), cache))
    torch.testing.assert_close(torch.cat(pieces), outputs["seq2_logits_debug_no_fake_quant"], rtol=0, atol=1e-5)


def test_sequences_batched_in_one_step_equal_one_at_a_time(golden):
    """Three sequences in one flat batch (one prefilling, two decoding) give each one's own logits."""
    inputs, _ = golden
    model = load_model(GOLDEN, simulate_quantization=False)
    prompts = [inputs["sequences"][name]["input_ids"] for name in SEQUENCES]
    alone = [full_forward(model, p)[-1] for p in prompts]
    cache = ModelCache.allocate(model.config, 3, 128)
    model(ForwardBatch.build([(1, prompts[1][:-1], 0), (2, prompts[2][:-1], 0)]), cache)
    batched = model(ForwardBatch.build([(0, prompts[0], 0), (1, prompts[1][-1:], len(prompts[1]) - 1),
                                        (2, prompts[2][-1:], len(prompts[2]) - 1)]), cache)
    torch.testing.assert_close(batched, torch.stack(alone), rtol=0, atol=1e-5)


def test_a_reused_slot_starts_a_fresh_sequence(model, golden):
    """The Engram look-back and the compressed stores of a slot's previous sequence do not leak."""
    inputs, _ = golden
    first, second = inputs["sequences"]["seq2"]["input_ids"], inputs["sequences"]["seq1"]["input_ids"]
    cache = ModelCache.allocate(model.config, 1, 128)
    model(ForwardBatch.build([(0, first, 0)]), cache)
    reused = model(ForwardBatch.build([(0, second, 0)], logits="all"), cache)
    torch.testing.assert_close(reused, full_forward(model, second), rtol=0, atol=0)
