"""Drafting off while the draft policy verifies none (issue 27, item 5): the policy decides once per step,
as its sampling chunks are launched, whether their next chunks may verify drafts (scheduler/spec_policy.py
drafting_next, the probe schedule included: every PROBE_EVERY-th step while drafting does not pay, all its
chunks at once), each chunk carries that as `draft_next`, and after a chunk without it the MTP and DSpark
proposers skip their drafting (chained steps, block, host read) but keep their own state exact. A request
whose next chunk cannot take drafts (under min_tokens; a grammar: tests/test_spec_engine.py) never asks and
never probes. Driven through the scheduler and a real runner (tiny V4 with its MTP layer, tiny V4.1 with a
DSpark draft, CPU, deterministic mode) with the policy's step cost fixed by phase: greedy output is plain
greedy's bitwise through drafting on, off (with probe steps) and on again, a request under min_tokens
beside; every draft proposed equals the draft model run afresh over the whole sequence, after the off
phase too; nothing is proposed after a chunk without `draft_next`; a probe's next chunk verifies one
draft; at a batch of 8 exactly one step in PROBE_EVERY probes, with all its chunks; and the proposer's
draft steps, run and skipped, reach the engine's counters and /metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contract import (
    ChunkResult,
    EngineLimits,
    EngineStats,
    NewRequest,
    SamplingParams,
    SpecDecodeCounts,
    StepResult,
    StructuredOutput,
    TokenLogprob,
)
from models.random_model import build_random_model
from scheduler.scheduler import Scheduler
from scheduler.spec_policy import PROBE_EVERY, Drafting, SpeculationPolicy, StepCost
from server.metrics import engine_figures
from tests.conftest import random_tokens
from tests.test_dspark import K as DSPARK_K
from tests.test_dspark import PROMPT as DSPARK_PROMPT
from tests.test_dspark import dirs, drafts_afresh, with_draft  # noqa: F401  (dirs: the fixture)
from tests.test_proposers import CONFIG as MTP_CONFIG
from tests.test_proposers import K as MTP_K
from tests.test_proposers import PROMPT as MTP_PROMPT
from tests.test_proposers import mtp_drafts_afresh
from tests.test_spec_engine import policy_after
from worker import ModelRunner
from worker.dspark import DSparkProposer
from worker.proposers import MTPProposer

torch.set_num_threads(1)

CHEAP = (1.0, 0.0)  # (fixed, per_row) seconds: rows are free, so drafting pays
COSTLY = (0.0, 1.0)  # every row costs the same: no draft below certain acceptance pays
MAX_LEN, BLOCK, BUDGET = 128, 16, 16  # the 27-token prompts prefill in two chunks


@dataclasses.dataclass
class FixedCost(StepCost):
    """The policy's step cost, set by the test instead of fit from timings (None: not measured yet)."""

    known: tuple[float, float] | None = None

    def fit(self) -> tuple[float, float] | None:
        return self.known


def fixed_policy() -> SpeculationPolicy:
    return SpeculationPolicy(FixedCost(), [], [])


# -- the policy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accepted", [0, 1, 2, (0, 1), (0, 3), 3])
@pytest.mark.parametrize("fixed_s, per_row_s", [(1.7e-3, 0.16e-3), (1e-3, 1e-3), (5e-3, 0.02e-3)])
def test_drafting_next_says_on_exactly_where_some_draft_count_pays(accepted, fixed_s, per_row_s):
    """Without knowing K, drafting_next answers whether draft_count would verify any of K = 3 drafts,
    at every batch size (policies that draft at small batches and not at large ones among them); only
    the steps where it would not count toward the next probe."""
    policy = policy_after(fixed_s, per_row_s, carried=3, accepted=accepted)
    for batch in (1, 2, 4, 8, 16, 32, 64, 256):
        pays = policy.draft_count(batch, proposed=3) > 0
        steps = policy.steps
        wish = policy.drafting_next(batch)
        assert (wish is Drafting.ON) == pays, (batch, wish)
        assert policy.steps == steps + (not pays)  # only steps that do not pay count toward a probe
    unmeasured = SpeculationPolicy.fresh()
    assert unmeasured.drafting_next(64) is Drafting.ON and unmeasured.draft_count(64, 3) == 3


# -- the scheduler ---------------------------------------------------------------------------------------
def test_the_scheduler_wants_drafts_a_step_ahead_and_verifies_one_after_a_probe():
    """Pure scheduler, one request, results written by hand (drafts proposed only where a chunk asked for
    them): while drafting does not pay each decode chunk asks for none, except every PROBE_EVERY-th
    step's, whose next chunk verifies one draft; once drafting pays again every chunk asks and the next
    verifies all; the draft steps a result reports are counted."""
    scheduler = Scheduler(EngineLimits(2, 32, 512, 64, eos_token_ids=(1,)))
    scheduler.spec_policy = policy = fixed_policy()
    policy.cost.known = COSTLY
    scheduler.add(NewRequest("r", (5, 9, 2), SamplingParams(max_tokens=200, ignore_eos=True)))
    switch = 3 * PROBE_EVERY + 1  # drafting pays from this step on
    asked, verified = [], []
    for step in range(switch + 3):
        if step == switch:
            policy.cost.known = CHEAP
        plan = scheduler.schedule()
        (chunk,) = plan.chunks
        asked.append(chunk.draft_next)
        verified.append(len(chunk.draft_token_ids))
        proposed = (21, 22, 23) if chunk.draft_next else ()
        result = StepResult((ChunkResult("r", TokenLogprob(20, -1.0), proposed=proposed),),
                            draft_steps=int(chunk.draft_next), skipped_draft_steps=int(not chunk.draft_next))
        scheduler.update(plan, result)
    probes = [i for i, a in enumerate(asked[:switch]) if a]
    assert probes == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]  # the prompt chunk counts too
    assert [verified[i + 1] for i in probes] == [1, 1, 1]  # a probe's next chunk verifies one draft
    assert sum(verified[:switch]) == 3  # and no other chunk while drafting does not pay
    assert all(asked[switch:]) and verified[switch + 1:] == [3, 3]
    counts = scheduler.stats().spec
    assert (counts.draft_steps, counts.skipped_draft_steps) == (3 + 3, switch - 3)


def test_requests_that_cannot_take_drafts_never_ask_nor_count_toward_a_probe():
    """Pure scheduler, drafting never paying: a grammar-constrained request and one under min_tokens ask
    for no drafts, and steps of only them do not count toward the probe schedule; once a free request
    joins, its first probe step is its PROBE_EVERY-th, and in it the other two still do not ask."""
    scheduler = Scheduler(EngineLimits(3, 64, 512, 64, eos_token_ids=(1,)))
    scheduler.spec_policy = policy = fixed_policy()
    policy.cost.known = COSTLY
    grammar = StructuredOutput("regex", "[a-z]+")
    scheduler.add(NewRequest("g", (5, 9, 2), SamplingParams(max_tokens=200, ignore_eos=True, structured=grammar)))
    scheduler.add(NewRequest("m", (5, 9, 3), SamplingParams(max_tokens=200, min_tokens=100, ignore_eos=True)))
    asked: list[dict[str, bool]] = []

    def step() -> None:
        plan = scheduler.schedule()
        asked.append({chunk.request_id: chunk.draft_next for chunk in plan.chunks if chunk.sample})
        scheduler.update(plan, StepResult(tuple(
            ChunkResult(chunk.request_id, TokenLogprob(20, -1.0), proposed=(21, 22) if chunk.draft_next else ())
            for chunk in plan.chunks)))

    for _ in range(2 * PROBE_EVERY):
        step()
    assert policy.steps == 0 and not any(any(step.values()) for step in asked)
    scheduler.add(NewRequest("f", (5, 9, 4), SamplingParams(max_tokens=200, ignore_eos=True)))
    for _ in range(PROBE_EVERY + 1):
        step()
    joined = asked[2 * PROBE_EVERY:]
    assert [index for index, step in enumerate(joined) if any(step.values())] == [PROBE_EVERY - 1]
    assert joined[PROBE_EVERY - 1] == {"g": False, "m": False, "f": True} and policy.steps == PROBE_EVERY + 1


def test_the_draft_step_counters_reach_the_metrics():
    stats = EngineStats(running=0, waiting=0, spec=SpecDecodeCounts().add_draft_steps(7, 40).add(3, 1))
    figures = {name: value for _, name, _, value in engine_figures("ds4serve", stats)}
    assert figures["spec_decode_num_draft_steps"] == 7 and figures["spec_decode_num_skipped_draft_steps"] == 40
    assert figures["spec_decode_num_drafts"] == 1 and figures["spec_decode_num_accepted_tokens"] == 1
    assert "spec_decode_num_skipped_draft_steps" not in {name for _, name, _, _ in engine_figures("vllm", stats)}


# -- through a runner: MTP and DSpark ---------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """What `serve` saw: each request's tokens and logprobs; per step and sampling chunk, (request, whether
    it asked for drafts, the drafts it verified, the drafts proposed after it, the tokens so far)."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list]
    chunks: list[list[tuple[str, bool, int, tuple[int, ...], tuple[int, ...]]]]
    spec: SpecDecodeCounts


def serve(model, prompts: dict[str, tuple[int, ...]], length: int, proposer=None, k: int = 0,
          phase=None, min_tokens: dict[str, int] | None = None, budget: int = BUDGET) -> Run:
    """Greedy decoding of `prompts` at once (a slot each) through a scheduler and a runner (deterministic),
    drafting with `proposer` (K = `k`) under a policy whose step cost `phase(step)` sets; without one,
    plain. `min_tokens`: per request, where one is asked."""
    limits = EngineLimits(len(prompts), budget, MAX_LEN, model.config.vocab_size, model.config.eos_token_ids,
                          block_tokens=BLOCK)
    scheduler = Scheduler(limits)
    scheduler.spec_policy = fixed_policy() if proposer is not None else None
    runner = ModelRunner(model, len(prompts), MAX_LEN, num_pages=limits.total_pages, block_tokens=BLOCK,
                         deterministic=True, draft_tokens=k, proposer=proposer)
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=length, ignore_eos=True)
    for rid, prompt in prompts.items():
        least = (min_tokens or {}).get(rid, 0)
        scheduler.add(NewRequest(rid, prompt, dataclasses.replace(params, min_tokens=least)))
    run = Run({rid: [] for rid in prompts}, {rid: [] for rid in prompts}, [], SpecDecodeCounts())
    step = 0
    while scheduler.has_work:
        if proposer is not None:
            scheduler.spec_policy.cost.known = phase(step)
        plan = scheduler.schedule()
        result = runner.execute(plan)
        for output in scheduler.update(plan, result):
            assert output.error is None, output.error
            run.tokens[output.request_id] += output.new_token_ids
            run.logprobs[output.request_id] += output.new_logprobs
        run.chunks.append([(c.request_id, c.draft_next, len(c.draft_token_ids), r.proposed,
                            (*prompts[c.request_id], *run.tokens[c.request_id]))
                           for c, r in zip(plan.chunks, result.chunks) if c.sample])
        step += 1
    run.spec = scheduler.stats().spec
    return run


def on_off_on(step: int) -> tuple[float, float]:
    """Drafting pays for 6 steps, then not for 40 (a probe step every PROBE_EVERY), then pays again."""
    return CHEAP if step < 6 or step >= 46 else COSTLY


LEAST = 50  # min_tokens of the request "c" beside "a" and "b": it cannot take drafts through most of the run


def check_drafting_off_and_on(plain: Run, drafted: Run, afresh, k: int, prompt_c: tuple[int, ...]) -> None:
    assert drafted.tokens == plain.tokens
    assert drafted.logprobs == plain.logprobs  # logprobs and top-2 alternatives bitwise
    chunks = [chunk for step in drafted.chunks for chunk in step]
    asked = [a for _, a, _, _, _ in chunks]
    for rid, wanted, _, proposed, sequence in chunks:
        if wanted:  # the drafts of the draft model run afresh: its state was kept exact while off
            assert proposed == afresh(sequence), (rid, len(sequence))
        else:
            assert proposed == (), (rid, len(sequence))  # no drafting after a chunk that did not ask
    # "c" asks for nothing while its next chunk is under min_tokens (the sequence is the one after the
    # chunk), in the on phases and probe steps too, and asks from the chunk after which it is not
    c_chunks = [(wanted, verified, len(sequence) - len(prompt_c)) for rid, wanted, verified, _, sequence in chunks
                if rid == "c"]
    least = [(wanted, verified) for wanted, verified, outputs in c_chunks if outputs < LEAST]
    assert len(least) == LEAST - 1 and not any(wanted or verified for wanted, verified in least)
    assert [wanted for wanted, _, outputs in c_chunks if outputs == LEAST] == [True]  # the on phase by then
    # while off, a probe is a whole step: every chunk of "a" and "b" in it asks, in no other step any
    takers = [[wanted for rid, wanted, _, _, _ in step if rid != "c"] for step in drafted.chunks[7:45]]
    assert all(step and len(set(step)) == 1 for step in takers), takers
    probe_steps = [index for index, step in enumerate(takers) if step[0]]
    assert len(probe_steps) >= 2 and {b - a for a, b in zip(probe_steps, probe_steps[1:])} == {PROBE_EVERY}
    probes = [(rid, sequence) for step in drafted.chunks[7:45] for rid, wanted, _, _, sequence in step if wanted]
    assert len(probes) == 2 * len(probe_steps)
    following = {(rid, len(sequence)): verified for rid, _, verified, _, sequence in chunks}
    for rid, sequence in probes:  # the chunk after a probe verifies one draft (tokens fit: 1 + accepted)
        nexts = [v for (r, n), v in following.items() if r == rid and len(sequence) < n <= len(sequence) + 2]
        assert nexts and nexts[0] == 1, (rid, len(sequence))
    late = [verified for step in drafted.chunks[48:] for _, _, verified, _, _ in step]
    assert late and max(late) == k  # drafting back on verifies every draft again
    assert drafted.spec.skipped_draft_steps == asked.count(False) > 30 + LEAST  # "c"'s count as skipped
    assert drafted.spec.draft_steps == asked.count(True) > len(probes)


@pytest.fixture(scope="module")
def mtp_model():
    return build_random_model(MTP_CONFIG, torch.float32, "cpu", seed=2, mtp=True)


def test_mtp_drafting_off_and_back_on_keeps_greedy_and_drafts_as_afresh(mtp_model):
    prompts = {"a": MTP_PROMPT, "b": tuple(random_tokens(27, seed=11)), "c": tuple(random_tokens(27, seed=13))}
    plain = serve(mtp_model, prompts, 60, min_tokens={"c": LEAST})
    proposer = MTPProposer(mtp_model, num_slots=3, max_model_len=MAX_LEN, k=MTP_K)
    drafted = serve(mtp_model, prompts, 60, proposer, MTP_K, on_off_on, min_tokens={"c": LEAST})
    check_drafting_off_and_on(plain, drafted, lambda tokens: mtp_drafts_afresh(mtp_model, list(tokens)), MTP_K,
                              prompts["c"])


def test_dspark_drafting_off_and_back_on_keeps_greedy_and_drafts_as_afresh(dirs):  # noqa: F811
    model = with_draft(dirs)
    prompts = {"a": DSPARK_PROMPT, "b": tuple(random_tokens(27, seed=12)), "c": tuple(random_tokens(27, seed=14))}
    plain = serve(model, prompts, 60, min_tokens={"c": LEAST})
    proposer = DSparkProposer(model, num_slots=3, k=DSPARK_K)
    drafted = serve(model, prompts, 60, proposer, DSPARK_K, on_off_on, min_tokens={"c": LEAST})
    check_drafting_off_and_on(plain, drafted, lambda tokens: drafts_afresh(model, list(tokens)), DSPARK_K,
                              prompts["c"])


def test_at_a_batch_of_8_one_step_in_probe_every_probes_with_all_its_chunks(mtp_model):
    """MTP, 8 requests at once, drafting never paying (COSTLY from the first step): the steps whose chunks
    ask for drafts are exactly every PROBE_EVERY-th, every sampling chunk of them asks (all 8 verify one
    draft in the step after), no chunk of any other step asks, the proposer's counters say so, and greedy
    output is plain greedy's bitwise."""
    batch, length = 8, 3 * PROBE_EVERY + 4
    prompts = {f"r{i}": tuple(random_tokens(10, seed=20 + i)) for i in range(batch)}
    proposer = MTPProposer(mtp_model, num_slots=batch, max_model_len=MAX_LEN, k=MTP_K)
    run = serve(mtp_model, prompts, length, proposer, MTP_K, lambda step: COSTLY, budget=128)
    plain = serve(mtp_model, prompts, length, budget=128)
    assert (run.tokens, run.logprobs) == (plain.tokens, plain.logprobs)
    asking = [[wanted for _, wanted, _, _, _ in step] for step in run.chunks]
    assert all(len(step) == batch for step in asking[:3 * PROBE_EVERY + 1])  # one prefill step, then decodes
    probe_steps = [index for index, step in enumerate(asking) if any(step)]
    assert probe_steps == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    assert all(all(asking[index]) for index in probe_steps)  # a probe step's every chunk probes
    verified = [[count for _, _, count, _, _ in step] for step in run.chunks]
    assert [index for index, step in enumerate(verified) if any(step)] == [index + 1 for index in probe_steps]
    assert all(verified[index + 1] == [1] * batch for index in probe_steps)  # acceptance stays measured
    chunks = sum(len(step) for step in asking)
    assert run.spec.draft_steps == batch * len(probe_steps) == run.spec.drafts
    assert run.spec.skipped_draft_steps == chunks - batch * len(probe_steps)
