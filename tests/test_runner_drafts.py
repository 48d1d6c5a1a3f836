"""A runner with draft rows verifies drafts (issue 27 items 2-3, the worker's part): a chunk carries the
last token and up to K drafts, the runner draws at each position, keeps the drafts while each is the
token drawn there and reports them with the token drawn after them. Greedy with drafts emits exactly
the tokens and logprobs of plain greedy decoding (deterministic mode, on CPU, V4's and V4.1's tiny models), whatever
the drafts, and a seeded sampled request emits what the same seed draws without drafts."""

from __future__ import annotations

import pytest
import torch

from contract import SamplingParams, ScheduledChunk, StepPlan, TokenLogprob
from models import ModelConfig, load_model
from models.random_model import build_random_model
from models.tiny import tiny_config_dict
from tests.conftest import random_tokens
from worker import ModelRunner

DRAFTS = 3
PROMPT = tuple(random_tokens(29, seed=1))


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request, checkpoints):
    """V4's tiny model, and the tiny V4.1 (its Engram look-back rewound after a rejected draft, its shared
    stores' open groups in rings with spare rows)."""
    if request.param == "v41":
        return load_model(checkpoints["v41"])
    return build_random_model(ModelConfig.from_dict(tiny_config_dict()), torch.float32, "cpu", seed=0)


def step(runner: ModelRunner, tokens: tuple[int, ...], position: int, params: SamplingParams, generated: int,
         drafts: tuple[int, ...] = (), history: tuple[int, ...] = ()) -> tuple[TokenLogprob, ...]:
    """One sampling chunk of request "r" in slot 0; its new tokens (accepted drafts, then the drawn one)."""
    chunk = ScheduledChunk(request_id="r", slot=0, pages=tuple(runner.cache.default_pages(0).tolist()),
                           token_ids=tokens, position=position, sample=True, logprob_targets=(), params=params,
                           num_generated=generated, output_token_ids=history, draft_token_ids=drafts)
    (result,) = runner.execute(StepPlan((chunk,))).chunks
    assert result.error is None
    return result.new_tokens


def plain_stream(model, params: SamplingParams, length: int) -> list[TokenLogprob]:
    runner = ModelRunner(model, num_slots=1, max_model_len=128, deterministic=True)
    out = list(step(runner, PROMPT, 0, params, 0))
    while len(out) < length:
        out += step(runner, (out[-1].token_id,), len(PROMPT) + len(out) - 1, params, len(out),
                    history=tuple(t.token_id for t in out))
    return out


def drafted_stream(model, params: SamplingParams, length: int, proposer) -> tuple[list[TokenLogprob], int]:
    """The stream decoded with `proposer(emitted so far) -> drafts`; also the drafts accepted in all."""
    runner = ModelRunner(model, num_slots=1, max_model_len=128, deterministic=True, draft_tokens=DRAFTS)
    out = list(step(runner, PROMPT, 0, params, 0))
    accepted = 0
    while len(out) < length:
        drafts = proposer(out)
        new = step(runner, (out[-1].token_id,), len(PROMPT) + len(out) - 1, params, len(out), drafts,
                   history=tuple(t.token_id for t in out))
        assert 1 <= len(new) <= len(drafts) + 1 and [t.token_id for t in new[:-1]] == list(drafts[: len(new) - 1])
        accepted += len(new) - 1
        out += new
    return out, accepted


def test_greedy_with_drafts_emits_plain_greedys_tokens_and_logprobs(model):
    """Drafts from an oracle that knows plain greedy's stream, right at each draft with probability
    0.6 (else off by one id), 0 to 3 of them: the same tokens and bitwise logprobs (with top-3)."""
    params = SamplingParams(temperature=0.0, logprobs=3, max_tokens=40)
    reference = plain_stream(model, params, 40)
    generator = torch.Generator().manual_seed(3)

    def oracle(emitted: list[TokenLogprob]) -> tuple[int, ...]:
        count = int(torch.randint(0, DRAFTS + 1, (), generator=generator))
        truth = [t.token_id for t in reference[len(emitted): len(emitted) + count]]
        return tuple(t if torch.rand((), generator=generator) < 0.6 else t + 1 for t in truth)

    drafted, accepted = drafted_stream(model, params, 40, oracle)
    assert drafted[:40] == reference[:40]
    assert accepted >= 5  # some drafts passed: the stream was not decoded one token a step


def test_a_seeded_sampled_request_draws_its_tokens_with_or_without_drafts(model):
    """temperature 0.9 with a seed: a draw is keyed by (seed, draw index), so drafting its own tokens
    (always right: every draft passes) or wrong tokens (every draft fails) emits the same stream."""
    params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=30)
    reference = plain_stream(model, params, 30)
    right = lambda emitted: tuple(t.token_id for t in reference[len(emitted): len(emitted) + DRAFTS])  # noqa: E731
    wrong = lambda emitted: tuple((t + 1) % 512 for t in right(emitted))  # noqa: E731
    for proposer in (right, wrong):
        drafted, accepted = drafted_stream(model, params, 30, proposer)
        assert [t.token_id for t in drafted[:30]] == [t.token_id for t in reference[:30]]
    assert accepted == 0  # the wrong drafts: none passed


def test_a_runner_refuses_more_drafts_than_its_rows(model):
    runner = ModelRunner(model, num_slots=1, max_model_len=64, deterministic=True, draft_tokens=2)
    with pytest.raises(ValueError, match="at most 2"):
        step(runner, PROMPT, 0, SamplingParams(temperature=0.0), 0, drafts=(1, 2, 3))
