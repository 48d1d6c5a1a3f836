"""Rolling back rejected drafts (issue 27 item 3) is resuming at the accepted position: a cache with
`draft_tokens` rows to spare in its rings (ModelCache.allocate) that computed drafts a verify step then
rejected gives, from there on, the logits of a cache that never saw them, bit for bit in deterministic
mode (on CPU, V4's tiny model: window 16, CSA rate 4 with its indexer, HCA rate 16)."""

from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import BatchInvariantMode
from models import DecodeBatch, ForwardBatch, ModelCache, ModelConfig
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens

DRAFTS = 3


def verify_rounds(model, seed: int, rounds: int = 24) -> tuple[ModelCache, ModelCache, int, int]:
    """A prompt on a drafting and a plain cache, then `rounds` rounds of a verify chunk (the last token and
    3 drafts) on the drafting one and its accepted part alone on the plain one: the accepted rows'
    logits must agree bitwise (and V4.1's Engram look-back, put back as the runner puts it back).
    Returns the caches and the next (position, token)."""
    memory = model.engram_memory
    drafting = ModelCache.allocate(model.config, 1, 160, draft_tokens=DRAFTS)
    plain = ModelCache.allocate(model.config, 1, 160)
    generator = torch.Generator().manual_seed(seed)
    prompt = random_tokens(37, seed=seed + 1)
    with BatchInvariantMode():
        for cache in (drafting, plain):
            model(ForwardBatch.build([(0, prompt, 0)]), cache)
        position, last = len(prompt), 7
        for round_ in range(rounds):
            drafts = random_tokens(DRAFTS, seed=100 * seed + round_)
            accepted = int(torch.randint(0, DRAFTS + 1, (), generator=generator))
            before = drafting.engram_context[0].tolist() if memory is not None else None
            verified = model(ForwardBatch.build([(0, [last, *drafts], position)], logits="all"), drafting)
            if memory is not None:
                memory.rewind(drafting.engram_context, 0, before, [last, *drafts[:accepted]])
            kept = model(ForwardBatch.build([(0, [last, *drafts[:accepted]], position)], logits="all"), plain)
            assert torch.equal(verified[: accepted + 1], kept), f"round {round_}"
            if memory is not None:
                assert torch.equal(drafting.engram_context, plain.engram_context), f"round {round_}"
            position += accepted + 1
            last = int(random_tokens(1, seed=500 * seed + round_)[0])
    assert position > len(prompt) + 2 * 16  # the rounds went past two of the largest windows
    return drafting, plain, position, last


def test_rejected_drafts_leave_no_trace():
    """V4's tiny model: across ring wraps of the window and closes of CSA and HCA windows (some by drafts
    that were then rejected), verify chunks leave the accepted part's logits (`verify_rounds`); the
    decode path (what the graphs run) reads the larger ring by its window too: its keys come in
    ring-row order, so the two caches then agree to float-sum order."""
    model = build_random_model(ModelConfig.from_dict(tiny_config_dict()), torch.float32, "cpu", seed=0)
    drafting, plain, position, last = verify_rounds(model, seed=1)
    for step in range(20):
        batch = DecodeBatch.build([(0, last, position, drafting.default_pages(0).tolist())], width=10)
        torch.testing.assert_close(model.decode(batch, drafting), model.decode(batch, plain), rtol=1e-4, atol=1e-4,
                                   msg=f"decode step {step}")
        position, last = position + 1, int(random_tokens(1, seed=900 + step)[0])


def test_v41_rejected_drafts_leave_no_trace(checkpoints):
    """The tiny V4.1 (Engram on two layers, shared kv sources of rates 2 and 1, a window of 16): the same
    rounds, its look-back put back after each (EngramMemory.rewind); its shared stores' open groups
    need nothing. Then the decode path agrees too."""
    from models import load_model

    model = load_model(checkpoints["v41"])
    drafting, plain, position, last = verify_rounds(model, seed=3)
    for step in range(12):
        batch = DecodeBatch.build([(0, last, position, drafting.default_pages(0).tolist())], width=10)
        logits = [model.decode(batch, cache, model.engram_rows([0], [last], [position], cache))
                  for cache in (drafting, plain)]
        torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
        position, last = position + 1, int(random_tokens(1, seed=950 + step)[0])
