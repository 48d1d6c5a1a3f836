"""Draft proposers (worker/proposers.py, issue 27 item 1) driven through a real runner: V4's MTP layer
and prompt lookup. Greedy decoding that feeds each step's proposed drafts back as the next step's drafts
emits exactly plain greedy's tokens and logprobs (deterministic mode, tiny V4 on CPU), with the prompt
prefilled in chunks; the MTP proposer's incremental drafts (its own window state kept across chunks,
rejected rows left behind) equal the drafts of the MTP layer run afresh over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from contract import SamplingParams, ScheduledChunk, StepPlan, TokenLogprob
from models import ForwardBatch, ModelConfig
from models.config import CSA, SLIDING
from models.mtp import allocate_mtp_cache, greedy_drafts
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens
from worker import ModelRunner
from worker.proposers import MTPProposer, NgramProposer, build_proposer

K = 3
PROMPT = tuple(random_tokens(27, seed=4))
GREEDY = SamplingParams(temperature=0.0, logprobs=2, max_tokens=64)
CONFIG = ModelConfig.from_dict(tiny_config_dict(num_nextn_predict_layers=1, num_hidden_layers=2,
                                                layer_types=[SLIDING, CSA], mlp_layer_types=["hash_moe", "moe"]))


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, torch.float32, "cpu", seed=2, mtp=True)


def chunk(runner: ModelRunner, tokens: tuple[int, ...], position: int, sample: bool, generated: int = 0,
          drafts: tuple[int, ...] = ()) -> ScheduledChunk:
    return ScheduledChunk(request_id="r", slot=1, pages=tuple(runner.cache.default_pages(1).tolist()), token_ids=tokens,
                          position=position, sample=sample, logprob_targets=(), params=GREEDY,
                          num_generated=generated, draft_token_ids=drafts)


def decode(runner: ModelRunner, length: int, on_step=None, prompt: tuple[int, ...] = PROMPT
           ) -> tuple[list[TokenLogprob], list[int]]:
    """Greedy decoding of `prompt` (prefilled in chunks of 11, 11 and 5) for `length` tokens, each step's
    drafts the step before's `proposed`; also how many drafts each verify step accepted."""
    for start in (0, 11):
        (result,) = runner.execute(StepPlan((chunk(runner, prompt[start:start + 11], start, False),))).chunks
        assert result.sampled is None and result.proposed == ()
    (result,) = runner.execute(StepPlan((chunk(runner, prompt[22:], 22, True),))).chunks
    out, accepted = list(result.new_tokens), []
    while len(out) < length:
        drafts = result.proposed
        if on_step is not None:
            on_step(out, drafts)
        position = len(prompt) + len(out) - 1
        (result,) = runner.execute(StepPlan((chunk(runner, (out[-1].token_id,), position, True, len(out),
                                                   drafts),))).chunks
        assert result.error is None
        accepted.append(len(result.accepted))
        out += result.new_tokens
    return out[:length], accepted


def plain(model, length: int) -> list[TokenLogprob]:
    return decode(ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True), length)[0]


def test_ngram_lookup_takes_the_longest_suffix_seen_before():
    proposer = NgramProposer(num_slots=1, k=3, min_n=1, max_n=4)
    assert proposer.lookup([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2]) == (3, 4, 9)  # [1, 2] at 0 beats [2] at 5
    assert proposer.lookup([5, 6, 5, 6, 7, 5, 6]) == (7, 5, 6)  # the latest occurrence of [5, 6]
    assert proposer.lookup([1, 2, 3]) == ()
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(num_slots=1, k=3, min_n=3, max_n=2)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_greedy_with_proposed_drafts_is_plain_greedy(model, method):
    want = plain(model, 24)
    proposer = build_proposer(method, model, num_slots=2, max_model_len=128, k=K)
    runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K, proposer=proposer)
    sent = []
    got, accepted = decode(runner, 24, lambda out, drafts: sent.append(len(drafts)))
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert got == want  # logprobs and top-2 alternatives bitwise
    assert sum(sent) >= 2 * K  # the proposer proposed, and the steps verified what it did


def mtp_drafts_afresh(model, tokens: list[int]) -> tuple[int, ...]:
    """The MTP layer's K greedy drafts after `tokens` (the prompt and the tokens emitted so far, the last
    just sampled), computed from scratch: the target over all but the last token for its streams, the
    layer over every row in one chunk, then K - 1 chained steps."""
    config = model.config
    cache = allocate_mtp_cache(config, 1, 128, dtype=torch.float32)
    target = ModelRunner(model, num_slots=1, max_model_len=128, deterministic=True)
    streams = torch.empty(len(tokens) - 1, config.hc_mult, config.hidden_size)
    target.model(ForwardBatch.build([(0, tokens[:-1], 0)]), target.cache, streams_out=streams)
    logits, out, _ = model.mtp[0](streams, ForwardBatch.build([(0, tokens[1:], 0)]), cache)
    first = logits.argmax(dim=-1)
    from models import DecodeBatch

    batch = DecodeBatch(first, torch.tensor([len(tokens) - 1]), torch.tensor([0]), cache.default_pages(0)[None])
    chained, _ = greedy_drafts(model.mtp[0], out[-1:], batch, cache, K - 1)
    return (int(first[0]), *chained[0].tolist())


def test_mtp_proposer_drafts_equal_the_layer_run_afresh(model):
    proposer = MTPProposer(model, num_slots=2, max_model_len=128, k=K)
    runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K, proposer=proposer)
    seen = []

    def check(out: list[TokenLogprob], drafts: tuple[int, ...]) -> None:
        seen.append(drafts == mtp_drafts_afresh(model, [*PROMPT, *(t.token_id for t in out)]))

    decode(runner, 12, check)
    assert seen and all(seen)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_a_pending_input_without_a_draw_before_reaches_no_proposer(model, method):
    """Under overlap a decode chunk's input may be the draw of the step before (PENDING_TOKEN); where that
    step drew nothing for the request (it failed there), the chunk computes token 0 and its result is not
    applied: the proposer never sees it, and the runner carries on."""
    from contract import PENDING_TOKEN

    proposer = build_proposer(method, model, num_slots=2, max_model_len=128, k=K)
    runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K, proposer=proposer)
    (first,) = runner.execute(StepPlan((chunk(runner, PROMPT, 0, True),))).chunks
    assert first.sampled is not None
    orphan = ScheduledChunk(request_id="failed-before", slot=0, pages=tuple(runner.cache.default_pages(0).tolist()),
                            token_ids=(PENDING_TOKEN,), position=5, sample=True, logprob_targets=(), params=GREEDY,
                            num_generated=1)
    follow = chunk(runner, (PENDING_TOKEN,), len(PROMPT), True, 1)
    results = runner.execute(StepPlan((orphan, follow))).chunks
    assert results[1].sampled is not None and results[1].error is None
