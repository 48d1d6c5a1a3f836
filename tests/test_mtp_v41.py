"""The V4.1 MTP layer (models/mtp_v41.py) served as the "mtp" proposer's draft model: a V4.1 checkpoint
with `num_nextn_predict_layers` loads it (the layer the default model trains beside its target,
tools/train_tiny.py); its decode steps give its chunk's numbers; drafts through a runner (the target's
streams and last pre mixes handed over) equal the layer run afresh and leave plain greedy's tokens and
bitwise logprobs; the fixed-shape draft steps equal the eager path; and the engine serves it through
the openai client with the tokens of plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from models import DecodeBatch, ForwardBatch, ModelCache, load_model
from models.mtp import allocate_mtp_cache, greedy_drafts
from models.mtp_v41 import MTPLayerV41
from models.tiny import build_tiny_checkpoint
from tests.serving import running_server
from tests.test_proposers import K, PROMPT, decode
from tests.test_mtp_draft_steps import check_static_steps_against_eager, computed
from tests.test_spec_engine import completions, spec_counters
from worker import ModelRunner
from worker.proposers import MTPProposer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mtp-v41") / "v41-mtp", seed=6, family="v41",
                                 num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, simulate_quantization=False, mtp=True)


def random_state(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target streams [n, hc, D] and last pre mixes [n, hc] (positive, summing to 1 as mixes do)."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    streams = torch.randn((n, config.hc_mult, config.hidden_size), generator=generator)
    return streams, torch.rand((n, config.hc_mult), generator=generator).softmax(dim=-1)


def test_loads_with_and_without_the_mtp_layer(checkpoint, model):
    assert isinstance(model.mtp[0], MTPLayerV41)
    assert load_model(checkpoint).mtp is None  # its mtp.* tensors left on disk
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer"):
        MTPProposer(load_model(checkpoint), num_slots=1, max_model_len=64, k=2)
    names = {name for name, _ in model.mtp[0].named_parameters()}
    assert {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"} <= names
    assert any(name.startswith("block.self_attn.") for name in names) and not any("hc_head" in n for n in names)


def test_decode_steps_give_the_chunks_numbers(model):
    """The same 20 rows as one chunk, and as a chunk of 6 then 14 decode steps (window rows wrap)."""
    layer, config = model.mtp[0], model.config
    streams, pre = random_state(model, 20, seed=2)
    tokens = list(range(30, 50))
    whole = allocate_mtp_cache(config, 2, 64)
    with torch.inference_mode():
        logits, out, out_pre = layer(streams, ForwardBatch.build([(1, tokens, 0)], logits="all"), whole, pre=pre)
        stepped = allocate_mtp_cache(config, 2, 64, draft_tokens=3)
        first, first_out, first_pre = layer(streams[:6], ForwardBatch.build([(1, tokens[:6], 0)], logits="all"),
                                            stepped, pre=pre[:6])
        rows, outs, pres = [first], [first_out], [first_pre]
        for p in range(6, 20):
            step = DecodeBatch.build([(1, tokens[p], p, stepped.default_pages(1).tolist())])
            row_out, row_pre = layer.advance(streams[p:p + 1], step, stepped, pre[p:p + 1])
            rows.append(layer.draft_logits(row_out, row_pre))
            outs.append(row_out)
            pres.append(row_pre)
    torch.testing.assert_close(torch.cat(rows), logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(pres), out_pre, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pre mixes"):
        layer(streams, ForwardBatch.build([(1, tokens, 0)]), whole)


def mtp_drafts_afresh(model, tokens: list[int]) -> tuple[int, ...]:
    """The layer's K greedy drafts after `tokens` computed from scratch: the target over all but the last
    token for its streams and pre mixes, the layer over every row in one chunk, K - 1 chained steps."""
    config = model.config
    target = ModelRunner(model, num_slots=1, max_model_len=128, deterministic=True)
    streams = torch.empty(len(tokens) - 1, config.hc_mult, config.hidden_size)
    pre = torch.empty(len(tokens) - 1, config.hc_mult)
    target.model(ForwardBatch.build([(0, tokens[:-1], 0)]), target.cache, streams_out=streams, pre_out=pre)
    cache = allocate_mtp_cache(config, 1, 128)
    with torch.inference_mode():
        logits, out, out_pre = model.mtp[0](streams, ForwardBatch.build([(0, tokens[1:], 0)]), cache, pre=pre)
        first = logits.argmax(dim=-1)
        batch = DecodeBatch(first, torch.tensor([len(tokens) - 1]), torch.tensor([0]), cache.default_pages(0)[None])
        chained, _ = greedy_drafts(model.mtp[0], out[-1:], batch, cache, K - 1, out_pre[-1:])
    return (int(first[0]), *chained[0].tolist())


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_steps"])
def test_greedy_with_mtp_drafts_is_plain_greedy_and_drafts_are_the_layers(model, static):
    """Deterministic mode through a runner (a prompt in chunks, then decoding with each step's drafts fed
    back): plain greedy's tokens and logprobs, every step's drafts those of the layer run afresh (eager
    path), or of the fixed-shape steps the CUDA graphs capture (run eagerly)."""
    want, _ = decode(ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True), 20)
    proposer = MTPProposer(model, num_slots=2, max_model_len=128, k=K)
    if static:
        proposer.use_static_steps()
    runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K, proposer=proposer)
    seen = []

    def check(out, drafts) -> None:
        seen.append(drafts == mtp_drafts_afresh(model, [*PROMPT, *(t.token_id for t in out)]))

    got, _ = decode(runner, 20, check)
    assert got == want
    assert seen and all(seen), seen
    assert not static or len(proposer.steps.runs) >= 10


def test_the_held_rows_keep_the_pre_mixes(model):
    """A slot whose chunks draft nothing holds its rows (streams and pre mixes); the chunk that drafts
    again runs them: the same drafts as a proposer that ran every row as it came."""
    held, eager = (MTPProposer(model, num_slots=1, max_model_len=128, k=K) for _ in range(2))
    config = model.config
    prompt = computed(0, tuple(range(20, 26)), 0, (), 6, 9, config=config)
    assert held.propose([prompt]) == eager.propose([prompt])
    for step in range(3):
        item = computed(0, (9 + step,), 6 + step, (), 1, 10 + step, draft_next=False, seed=step, config=config)
        assert held.propose([item]) == {}
        eager.propose([computed(0, (9 + step,), 6 + step, (), 1, 10 + step, seed=step, config=config)])
    item = computed(0, (12,), 9, (), 1, 13, seed=7, config=config)
    assert held.propose([item]) == eager.propose([item])
    torch.testing.assert_close(held.cache.layers[0].window[0], eager.cache.layers[0].window[0], rtol=1e-4, atol=1e-5)


def test_static_draft_steps_propose_the_eager_paths_drafts(model):
    """tests/test_mtp_draft_steps.py's script on V4.1: the pre mixes gathered and chained beside the streams."""
    check_static_steps_against_eager(model)


def test_served_v41_greedy_with_mtp_drafts_is_greedy_without_them(checkpoint):
    """The engine with --speculative-config method mtp on a V4.1 checkpoint with an MTP layer, through the
    openai client, 3 requests at once, deterministic: plain decoding's tokens and bitwise logprobs."""
    common = ("--deterministic", "--max-model-len", "256")
    with running_server(checkpoint, "spec", *common) as base:
        plain = completions(base)
    config = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    with running_server(checkpoint, "spec", *common, "--speculative-config", config) as base:
        assert completions(base) == plain
        drafts, tokens = spec_counters(base, "spec_decode_num_drafts", "spec_decode_num_draft_tokens")
        assert drafts > 0 and drafts <= tokens <= 2 * drafts, (drafts, tokens)


def test_a_v41_mtp_cache_holds_only_windows(model):
    cache = allocate_mtp_cache(model.config, 2, 64)
    assert isinstance(cache, ModelCache) and len(cache.layers) == 1 and cache.engram_context is None
