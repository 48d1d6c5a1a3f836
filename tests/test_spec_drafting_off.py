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
draft steps, run and skipped, reach the engine's counters and /metrics. The MTP layer itself (its
forwards logged step by step, `LayerLog`, against the rule, `check_held`) takes no decode row while
drafting is off: the rows wait in a buffer of held_rows(K) a slot, run at the probe step, when the
buffer would overflow (the request under min_tokens) or with a prompt chunk, and are dropped when the
slot's sequence restarts (preemption, abort and a new request, another request at the held end); the
buffer's bytes are counted exactly."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from contract import (
    ChunkResult,
    EngineLimits,
    EngineStats,
    NewRequest,
    ScheduledChunk,
    SamplingParams,
    SpecDecodeCounts,
    StepResult,
    StructuredOutput,
    TokenLogprob,
)
from models.mtp import allocate_mtp_cache
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
from worker.proposers import PROBE_EVERY_STEPS, ComputedChunk, MTPProposer, held_rows, mtp_proposer_bytes

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


def test_a_chunk_whose_next_has_no_room_for_a_draft_does_not_ask_for_drafts():
    """Pure scheduler, fixed K (no policy), drafts proposed wherever asked and all rejected: a request
    asks only while the chunk after has room for a draft past its own token. max_tokens 3 asks after
    its prompt (the next chunk verifies one draft) and then never (its third token is its last); a
    prompt 2 tokens short of max_model_len never asks; max_tokens 6 asks until its next chunk could
    only take its own token."""
    scheduler = Scheduler(EngineLimits(3, 64, 24, 64, eos_token_ids=(1,)))
    scheduler.add(NewRequest("short", (5, 9, 2), SamplingParams(max_tokens=3, ignore_eos=True)))
    scheduler.add(NewRequest("edge", tuple(range(2, 24)), SamplingParams(max_tokens=100, ignore_eos=True)))
    scheduler.add(NewRequest("free", (5, 9, 3), SamplingParams(max_tokens=6, ignore_eos=True)))
    asked: dict[str, list[bool]] = {}
    verified: dict[str, list[int]] = {}
    while scheduler.has_work:
        plan = scheduler.schedule()
        for chunk in plan.chunks:
            if chunk.sample:
                asked.setdefault(chunk.request_id, []).append(chunk.draft_next)
                verified.setdefault(chunk.request_id, []).append(len(chunk.draft_token_ids))
        scheduler.update(plan, StepResult(tuple(
            ChunkResult(chunk.request_id, TokenLogprob(20, -1.0), proposed=(21, 22) if chunk.draft_next else ())
            for chunk in plan.chunks)))
    assert asked["short"] == [True, False, False] and verified["short"] == [0, 1, 0]
    assert asked["edge"] == [False, False] and verified["edge"] == [0, 0]  # 22 + 2 tokens fill max_model_len 24
    assert asked["free"] == [True] * 4 + [False, False] and verified["free"] == [0, 2, 2, 2, 1, 0]


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
          phase=None, min_tokens: dict[str, int] | None = None, budget: int = BUDGET,
          num_pages: int | None = None, on_step: Callable[[int, Scheduler, dict], None] | None = None) -> Run:
    """Greedy decoding of `prompts` at once (a slot each) through a scheduler and a runner (deterministic),
    drafting with `proposer` (K = `k`) under a policy whose step cost `phase(step)` sets; without one,
    plain. `min_tokens`: per request, where one is asked. `num_pages`: KV pages (None: every slot's
    max length); `on_step(step, scheduler, prompts)` runs before each step is scheduled (it may abort a
    request, or add one to the scheduler and to `prompts`)."""
    prompts = dict(prompts)
    limits = EngineLimits(len(prompts), budget, MAX_LEN, model.config.vocab_size, model.config.eos_token_ids,
                          num_pages=num_pages, block_tokens=BLOCK)
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
        if on_step is not None:
            on_step(step, scheduler, prompts)
        if proposer is not None:
            scheduler.spec_policy.cost.known = phase(step)
        plan = scheduler.schedule()
        result = runner.execute(plan)
        for output in scheduler.update(plan, result):
            assert output.error is None, output.error
            run.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            run.logprobs.setdefault(output.request_id, []).extend(output.new_logprobs)
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


class LayerLog:
    """The MTP layer's forwards, a step at a time, while `proposer` proposes: per propose call, the chunks
    it got (those with rows) as (request, slot, position, kept rows, samples, draft_next, tokens), and the
    layer's chunks in its forward as {slot: (position, rows)} (the chained draft steps are decodes, not
    forwards). `close` takes the hook off the layer."""

    def __init__(self, proposer: MTPProposer) -> None:
        self.steps: list[tuple[list[tuple], dict[int, tuple[int, int]]]] = []
        self.inside = False
        self.propose, proposer.propose = proposer.propose, self.record
        self.hook = proposer.layer.register_forward_pre_hook(self.forward)

    def record(self, computed):
        self.steps.append(([(i.chunk.request_id, i.chunk.slot, i.chunk.position, i.kept, i.next_token is not None,
                             i.chunk.draft_next, len(i.chunk.token_ids)) for i in computed if i.streams is not None], {}))
        self.inside = True
        try:
            return self.propose(computed)
        finally:
            self.inside = False

    def forward(self, module, args) -> None:
        if self.inside:  # not the afresh drafts a check computes with the same layer
            ran = self.steps[-1][1]
            for chunk in args[1].chunks:
                assert chunk.slot not in ran  # one forward a step, one chunk a slot
                ran[chunk.slot] = (chunk.position, chunk.length)

    def close(self) -> None:
        self.hook.remove()


def check_held(log: LayerLog, k: int) -> tuple[dict[str, list[tuple[int, int, bool, bool]]], list[tuple[str, str, int]]]:
    """The layer's forwards against the rule, step by step (worker/proposers.py MTPProposer): a decode chunk
    that drafts nothing next runs nothing while its slot's rows not yet through the layer fit held_rows(k);
    any other chunk runs all of them with its own, in one chunk from where the layer's rows of its sequence
    end (a prompt chunk's last row waits for its token); a chunk that does not continue its slot's
    sequence drops what was held. Returns per request its runs (step, rows, whether it drafted after, whether
    at a decode chunk), and
    the drops (request that held, request that came, rows dropped)."""
    width = held_rows(k)
    slots: dict[int, tuple[str, int, int]] = {}  # slot -> (request, end of the rows run, end of the rows seen)
    runs: dict[str, list[tuple[int, int, bool, bool]]] = {}
    dropped = []
    for index, (chunks, ran) in enumerate(log.steps):
        assert set(ran) <= {chunk[1] for chunk in chunks}, index
        for rid, slot, position, kept, samples, draft_next, tokens in chunks:
            owner, done, seen = slots.get(slot, (rid, position, position))
            if (owner, seen) != (rid, position):  # the slot's sequence restarted: what it held is dropped
                if seen > done:
                    dropped.append((owner, rid, seen - done))
                done = position
            seen = position + kept
            ready = seen if samples else seen - 1  # rows whose next token is known
            if samples and not draft_next and tokens == 1 and seen - done <= width:
                assert slot not in ran, (index, rid)
            else:
                assert ran.get(slot) == ((done, ready - done) if ready > done else None), (index, rid, ran.get(slot))
                runs.setdefault(rid, []).append((index, ready - done, samples and draft_next, tokens == 1))
                done = ready
            slots[slot] = (rid, done, seen)
    return runs, dropped


@pytest.fixture(scope="module")
def mtp_on_off_on(mtp_model):
    """The requests "a", "b" and "c" (under min_tokens LEAST) served plain, and with MTP drafts through
    on_off_on: (prompts, plain, drafted, the layer's log)."""
    prompts = {"a": MTP_PROMPT, "b": tuple(random_tokens(27, seed=11)), "c": tuple(random_tokens(27, seed=13))}
    plain = serve(mtp_model, prompts, 60, min_tokens={"c": LEAST})
    proposer = MTPProposer(mtp_model, num_slots=3, max_model_len=MAX_LEN, k=MTP_K)
    log = LayerLog(proposer)
    drafted = serve(mtp_model, prompts, 60, proposer, MTP_K, on_off_on, min_tokens={"c": LEAST})
    log.close()
    return prompts, plain, drafted, log


def test_mtp_drafting_off_and_back_on_keeps_greedy_and_drafts_as_afresh(mtp_model, mtp_on_off_on):
    prompts, plain, drafted, _ = mtp_on_off_on
    check_drafting_off_and_on(plain, drafted, lambda tokens: mtp_drafts_afresh(mtp_model, list(tokens)), MTP_K,
                              prompts["c"])


def test_while_drafting_is_off_the_mtp_layer_runs_only_at_probe_steps(mtp_on_off_on):
    """Every forward of the layer follows the rule (check_held); in the off phase the layer takes no row of
    "a" or "b" but at the probe steps, where it takes every row held since their last run: PROBE_EVERY
    decode rows, one more where the chunk after the last probe accepted its draft."""
    _, _, drafted, log = mtp_on_off_on
    runs, dropped = check_held(log, MTP_K)
    assert not dropped
    probe_steps = [index for index in range(7, 45) if any(wanted for rid, wanted, _, _, _ in drafted.chunks[index]
                                                        if rid != "c")]
    for rid in "ab":
        off = [(step, rows, drafts) for step, rows, drafts, _ in runs[rid] if 7 <= step < 45]
        assert [step for step, _, _ in off] == probe_steps and all(drafts for _, _, drafts in off)
        assert all(PROBE_EVERY <= rows <= PROBE_EVERY + 1 for _, rows, _ in off[1:]), off
    rows_a_b = [sum(ran[slot][1] for slot in ran if slot != 2) for _, ran in log.steps[7:45]]  # "c" is slot 2
    assert {rows for index, rows in enumerate(rows_a_b, 7) if index not in probe_steps} == {0}
    assert all(rows_a_b[index - 7] >= 2 * PROBE_EVERY for index in probe_steps[1:])


def test_rows_held_past_the_buffer_run_the_layer(mtp_on_off_on):
    """"c", under min_tokens for LEAST tokens, never drafts while its neighbours do: past its prompt, the
    layer takes its rows only when one more would overflow its held_rows(K), in runs of held_rows(K) + 1."""
    _, _, drafted, log = mtp_on_off_on
    runs, _ = check_held(log, MTP_K)
    held = [(step, rows) for step, rows, drafts, decode in runs["c"] if decode and not drafts]
    assert len(held) >= (LEAST - 1) // (held_rows(MTP_K) + 1) >= 2
    assert {rows for _, rows in held[:-1]} == {held_rows(MTP_K) + 1}, held


def abort_b_for_q(step: int, scheduler: Scheduler, prompts: dict) -> None:
    """At step 25, "b" is aborted and "q" arrives (it takes "b"'s slot)."""
    if step == 25:
        assert scheduler.abort("b") is not None
        prompts["q"] = tuple(random_tokens(20, seed=15))
        scheduler.add(NewRequest("q", prompts["q"], SamplingParams(temperature=0.0, logprobs=2, max_tokens=30,
                                                                  ignore_eos=True)))


@pytest.mark.parametrize("restart", ["preempt", "abort"])
def test_a_restarted_slot_drops_what_it_held(mtp_model, restart):
    """Two requests, drafting never paying (rows held between probes): preempted under page pressure ("b"
    recomputes from its first token), or aborted with a new request taking its slot ("q"), a slot's held
    rows are dropped, never run over the sequence that follows (check_held); greedy output is plain
    greedy's and every draft that of the layer run afresh over the sequence it follows."""
    prompts = {"a": MTP_PROMPT, "b": tuple(random_tokens(27, seed=11))}
    # preempt: both grow to 6 pages of 9, so "b" is preempted, and recomputed once "a" is done
    num_pages, on_step = (9, None) if restart == "preempt" else (None, abort_b_for_q)
    plain = serve(mtp_model, prompts, 60, num_pages=num_pages, on_step=on_step)
    proposer = MTPProposer(mtp_model, num_slots=2, max_model_len=MAX_LEN, k=MTP_K)
    log = LayerLog(proposer)
    drafted = serve(mtp_model, prompts, 60, proposer, MTP_K, lambda step: COSTLY, num_pages=num_pages,
                    on_step=on_step)
    log.close()
    kept = ["a", "b"] if restart == "preempt" else ["a", "q"]
    assert {rid: drafted.tokens[rid] for rid in kept} == {rid: plain.tokens[rid] for rid in kept}
    _, dropped = check_held(log, MTP_K)
    restarted = [chunk for chunks, _ in log.steps for chunk in chunks if chunk[2] == 0]
    if restart == "preempt":
        # "b" from its first token again (more than once: readmitted as pages free, preempted as "a" grows)
        assert [rid for rid, *_ in restarted][:3] == ["a", "b", "b"] and {rid for rid, *_ in restarted} == {"a", "b"}
        assert {(held, came) for held, came, _ in dropped} == {("b", "b")} and dropped[0][2] > 1  # decode rows held
    else:
        assert [came for _, came, _ in dropped] == ["q"] and dropped[0][0] == "b"
    proposed = [(sequence, drafts) for step in drafted.chunks for rid, wanted, _, drafts, sequence in step if wanted]
    assert len(proposed) >= 4
    for sequence, drafts in proposed:
        assert drafts == mtp_drafts_afresh(mtp_model, list(sequence)), len(sequence)


def test_a_prompt_prefilled_in_small_chunks_drafts_as_afresh(mtp_model):
    """Each prompt chunk's last row waits in the buffer's first row, where the row it replaces is read by
    the same step's forward: with chunks of 5 tokens, rows that waited are in the layer's window when it
    first drafts, and every draft equals the layer run afresh."""
    proposer = MTPProposer(mtp_model, num_slots=1, max_model_len=MAX_LEN, k=MTP_K)
    run = serve(mtp_model, {"a": MTP_PROMPT}, 8, proposer, MTP_K, lambda step: CHEAP, budget=5)
    proposed = [(sequence, drafts) for step in run.chunks for _, wanted, _, drafts, sequence in step if wanted]
    assert len(proposed) >= 3
    for sequence, drafts in proposed:
        assert drafts == mtp_drafts_afresh(mtp_model, list(sequence)), len(sequence)


@pytest.mark.parametrize("rid, runs", [("r", (10, 4)), ("q", (13, 1))])
def test_held_rows_are_a_requests_even_where_another_continues_their_positions(mtp_model, rid, runs):
    """The proposer alone, chunks by hand in slot 0: "r" prefills 10 tokens, then holds 3 decode rows; the
    slot's next chunk, at the held end and drafting, runs them with its own when it is "r"'s, and drops
    them when it is another request's (one resuming from a prefix-cache point exactly there)."""
    config = mtp_model.config
    proposer = MTPProposer(mtp_model, num_slots=1, max_model_len=MAX_LEN, k=MTP_K)
    log = LayerLog(proposer)

    def computed(request_id: str, tokens: tuple[int, ...], position: int, draft_next: bool = False) -> ComputedChunk:
        chunk = ScheduledChunk(request_id, 0, (), tokens, position, True, (), SamplingParams(), 0, draft_next=draft_next)
        return ComputedChunk(chunk, len(tokens), 7, torch.randn(len(tokens), config.hc_mult, config.hidden_size))

    proposer.propose([computed("r", (5,) * 10, 0)])
    for position in (10, 11, 12):
        assert proposer.propose([computed("r", (7,), position)]) == {}
    drafts = proposer.propose([computed(rid, (7,), 13, draft_next=True)])
    log.close()
    assert [ran for _, ran in log.steps] == [{0: (0, 10)}, {}, {}, {}, {0: runs}]
    assert len(drafts[rid]) == MTP_K


def test_the_held_rows_are_counted_with_the_proposers_bytes(mtp_model):
    """The buffer is PROBE_EVERY + K - 1 rows of the target's streams a slot, and the proposer's bytes, the
    engine's and the plan's, count it (and the layer's cache, with its scratch slot) to the byte."""
    config, slots = mtp_model.config, 5
    assert PROBE_EVERY_STEPS == PROBE_EVERY and held_rows(MTP_K) == PROBE_EVERY + MTP_K - 1
    proposer = MTPProposer(mtp_model, num_slots=slots, max_model_len=MAX_LEN, k=MTP_K)
    assert proposer.held_streams.shape == (slots, held_rows(MTP_K), config.hc_mult, config.hidden_size)
    held = slots * held_rows(MTP_K) * config.hc_mult * config.hidden_size * 4  # float32
    assert proposer.device_bytes() == proposer.cache.nbytes() + held
    assert mtp_proposer_bytes(config, slots, MAX_LEN, MTP_K, torch.float32) == proposer.device_bytes()
    assert proposer.cache.num_slots == slots + 1  # the draft graphs' scratch slot
    half = allocate_mtp_cache(config, slots + 1, MAX_LEN, dtype=torch.bfloat16, device="meta", draft_tokens=MTP_K)
    assert mtp_proposer_bytes(config, slots, MAX_LEN, MTP_K, torch.bfloat16) == half.nbytes() + held // 2


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
