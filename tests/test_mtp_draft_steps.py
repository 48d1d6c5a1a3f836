"""The MTP proposer's fixed-shape draft steps (worker/mtp_graphs.py, what CUDA graphs capture) against
its eager path (worker/proposers.py, itself checked against the layer run afresh in tests/test_proposers.py),
on CPU: the same steps fed to both, with every count of standing rows a verify chunk can leave (1 to 1 + K),
prompt chunks beside decode chunks in one step, chunks whose next step drafts nothing, and a bucket wider
than the step. The drafts are the same tokens and each request's window ring the same entries (to float32
rounding: the decode path and the chunked forward sum in different orders)."""

from __future__ import annotations

import random

import pytest
import torch

from contract import SamplingParams, ScheduledChunk
from models import ModelConfig
from models.random_model import build_random_model
from tests.conftest import random_tokens
from tests.test_proposers import CONFIG, K, decode, plain
from worker import ModelRunner
from worker.proposers import ComputedChunk, MTPProposer

SLOTS = 4  # batch buckets 1, 2, 4: three sequences pad one
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, torch.float32, "cpu", seed=2, mtp=True)


def computed(slot: int, tokens: tuple[int, ...], position: int, drafts: tuple[int, ...], kept: int,
             next_token: int | None, draft_next: bool = True, seed: int = 0,
             like: torch.Tensor = torch.empty(0), config: ModelConfig = CONFIG, taps: int = 0) -> ComputedChunk:
    """A chunk as a step left it, the target's streams at its rows random (on `like`'s device and dtype),
    and a V4.1 `config`'s last pre mixes there (float32, positive, summing to 1); with `taps`, a DSpark
    proposer's taps [rows, taps, hidden] instead."""
    rows = len(tokens) + len(drafts)
    generator = torch.Generator().manual_seed(seed)
    if taps:
        tapped = torch.randn(rows, taps, config.hidden_size, generator=generator).to(like)
        chunk = ScheduledChunk(request_id=f"r{slot}", slot=slot, pages=(), token_ids=tokens, position=position,
                               sample=next_token is not None, logprob_targets=(), params=GREEDY, num_generated=0,
                               draft_token_ids=drafts, draft_next=draft_next)
        return ComputedChunk(chunk, kept, next_token, taps=tapped)
    streams = torch.randn(rows, config.hc_mult, config.hidden_size, generator=generator).to(like)
    pre = torch.rand(rows, config.hc_mult, generator=generator).softmax(-1).to(like.device) if config.is_v41 else None
    chunk = ScheduledChunk(request_id=f"r{slot}", slot=slot, pages=(), token_ids=tokens, position=position,
                           sample=next_token is not None, logprob_targets=(), params=GREEDY, num_generated=0,
                           draft_token_ids=drafts, draft_next=draft_next)
    return ComputedChunk(chunk, kept, next_token, streams, pre=pre)


def steps_script(seed: int, like: torch.Tensor = torch.empty(0), config: ModelConfig = CONFIG, taps: int = 0
                 ) -> tuple[list[list[ComputedChunk]], dict[int, int]]:
    """Slot 0 and 1 prefill (slot 1 in two chunks, its first a step of its own), then decode with K drafts
    each and a random number of them standing; slot 2 prefills in the middle, beside the decodes; every
    fourth step slot 1 drafts nothing next, but not in the last. Also each slot's position after them."""
    rng = random.Random(seed)
    prompts = {0: random_tokens(9, seed=1), 1: random_tokens(20, seed=2), 2: random_tokens(14, seed=3)}
    positions = {}
    setting = dict(like=like, config=config, taps=taps)
    script = [[computed(1, tuple(prompts[1][:12]), 0, (), 12, None, seed=rng.randrange(10**6), **setting)]]
    first = [computed(0, tuple(prompts[0]), 0, (), 9, rng.randrange(7, 500), seed=rng.randrange(10**6), **setting),
             computed(1, tuple(prompts[1][12:]), 12, (), 8, rng.randrange(7, 500), seed=rng.randrange(10**6),
                      **setting)]
    positions |= {0: 9, 1: 20}
    script.append(first)
    for step in range(12):
        chunks = []
        for slot in sorted(positions):
            drafts = tuple(rng.randrange(7, 500) for _ in range(K))
            kept = rng.randrange(1, K + 2) if step % 3 else K + 1  # every count, all of them standing too
            chunks.append(computed(slot, (rng.randrange(7, 500),), positions[slot], drafts, kept,
                                   rng.randrange(7, 500), draft_next=not (slot == 1 and step % 4 == 3 and step < 11),
                                   seed=rng.randrange(10**6), **setting))
            positions[slot] += kept
        if step == 5:
            chunks.append(computed(2, tuple(prompts[2]), 0, (), 14, rng.randrange(7, 500), seed=rng.randrange(10**6),
                                   **setting))
            positions[2] = 14
        script.append(chunks)
    return script, positions


def test_static_draft_steps_propose_the_eager_paths_drafts(model):
    check_static_steps_against_eager(model)


def check_static_steps_against_eager(model) -> None:
    config = model.config
    eager = MTPProposer(model, num_slots=SLOTS, max_model_len=128, k=K)
    static = MTPProposer(model, num_slots=SLOTS, max_model_len=128, k=K)
    steps = static.use_static_steps()
    proposed = 0
    script, positions = steps_script(seed=0, config=config)
    for step, chunks in enumerate(script):
        want, got = eager.propose(chunks), static.propose(chunks)
        assert got == want, f"step {step}"
        proposed += len(got)
    assert proposed >= 20 and len(steps.runs) >= 10  # the static steps drafted most of them
    assert 3 in steps.runs  # a bucket of 4 for 3 sequences: a padding sequence of scratch rows
    want, got = eager.cache.layers[0].window, static.cache.layers[0].window
    for slot, end in positions.items():  # each ring's rows of the positions a next row reads
        rows = [p % want.shape[1] for p in range(max(0, end - config.sliding_window), end)]
        torch.testing.assert_close(got[slot, rows], want[slot, rows], rtol=1e-4, atol=1e-5)


def test_held_rows_go_through_the_eager_path_first(model):
    """A slot whose last chunk drafted nothing holds its rows: its next chunk runs eagerly, with them."""
    proposer = MTPProposer(model, num_slots=1, max_model_len=128, k=K)
    steps = proposer.use_static_steps()
    proposer.propose([computed(0, tuple(random_tokens(6, seed=4)), 0, (), 6, 9)])
    proposer.propose([computed(0, (9,), 6, (), 1, 10, draft_next=False)])  # held: nothing runs
    assert steps.runs == []
    assert len(proposer.propose([computed(0, (10,), 7, (), 1, 11)])["r0"]) == K  # eager, with the held row
    assert steps.runs == []
    proposer.propose([computed(0, (11,), 8, (1, 2, 3), 2, 12)])
    assert steps.runs == [1]


def test_greedy_with_static_draft_steps_is_plain_greedy(model):
    """Through a runner: the tokens and logprobs of plain greedy, the drafts those of the eager path."""
    check_greedy_with_static_steps(model, lambda: MTPProposer(model, num_slots=2, max_model_len=128, k=K), 24)


def check_greedy_with_static_steps(model, make_proposer, length: int) -> None:
    """Deterministic greedy through a runner fed each step's drafts, with a proposer from `make_proposer`
    drafting eagerly, then through its static steps: plain greedy's tokens and logprobs both times, the
    same drafts, and some of them."""
    want = plain(model, length)
    drafts = {}
    for static in (False, True):
        proposer = make_proposer()
        if static:
            proposer.use_static_steps()
        runner = ModelRunner(model, num_slots=2, max_model_len=128, deterministic=True, draft_tokens=K,
                             proposer=proposer)
        sent = drafts[static] = []
        got, _ = decode(runner, length, lambda out, proposed: sent.append(proposed))
        assert got == want
    assert drafts[True] == drafts[False] and sum(map(len, drafts[True])) >= 2 * K


def test_a_step_of_too_many_rows_is_refused(model):
    proposer = MTPProposer(model, num_slots=1, max_model_len=128, k=1)
    steps = proposer.use_static_steps()
    from worker.mtp_graphs import DraftRows

    with pytest.raises(ValueError, match="1 to 2"):
        steps.draft([DraftRows(0, 0, (1, 2, 3), torch.zeros(3, CONFIG.hc_mult, CONFIG.hidden_size))])
