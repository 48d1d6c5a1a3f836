"""Overlapped scheduling (engine/loop.py, docs/overlap.md) against the serial loop, on the real runner
(a tiny V4, and the tiny V4.1 whose Engram rows are hashed from the overlapped inputs) in deterministic mode: every request's tokens and logprobs are bitwise the same, over chunked prefill,
preemption, prefix-cache hits, stop tokens, max_tokens, a seeded sampler, a penalized request (which
waits for its draws) and aborts; each request ends exactly once and nothing is lost or duplicated
when it finishes a step late."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from contract import PENDING_TOKEN, EngineLimits, NewRequest, RequestOutput, SamplingParams, StepPlan
from engine.loop import EngineCore
from models import load_model
from scheduler import Scheduler
from tests.conftest import random_tokens
from scheduler.spec_policy import Drafting, SpeculationPolicy, StepCost
from worker import ModelRunner
from worker.proposers import build_proposer

MAX_LEN, BLOCK = 160, 16


@dataclass
class Recorder:
    """The real runner, with the plans it was given kept (to see that steps did overlap)."""

    runner: ModelRunner
    plans: list[StepPlan] = field(default_factory=list)

    @property
    def pending_inputs(self) -> bool:
        return self.runner.pending_inputs

    @property
    def proposes_drafts(self) -> bool:
        return self.runner.proposes_drafts

    def launch(self, plan: StepPlan):
        self.plans.append(plan)
        return self.runner.launch(plan)

    def execute(self, plan: StepPlan):
        return self.launch(plan).result()

    def maintain(self) -> bool:
        return False

    def cancel(self, request_id: str) -> None:
        self.runner.cancel(request_id)


class Outputs:
    def __init__(self) -> None:
        self.by_request: dict[str, list[RequestOutput]] = {}

    def __call__(self, outputs) -> None:
        for output in outputs:
            assert not self.finished(output.request_id), f"{output.request_id}: an output after its last"
            self.by_request.setdefault(output.request_id, []).append(output)

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.by_request.get(rid, ()))

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.by_request[rid] for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list[float]:
        return [lp.logprob for o in self.by_request[rid] for lp in o.new_logprobs]

    def reason(self, rid: str) -> str | None:
        return self.by_request[rid][-1].finish_reason


def run(model, requests: list[NewRequest], overlap: bool, aborts: dict[int, str] | None = None,
        num_pages: int = 14, then: list[NewRequest] = (), drafts: int = 0, method: str = "mtp",
        policy: SpeculationPolicy | None = None) -> tuple[Outputs, Recorder, Scheduler]:
    """Steps an engine on this thread (aborts[k]: the request aborted before step k) until all ended,
    then `then` the same way. `drafts`: the runner drafts that many tokens with `method`'s proposer (the
    model's MTP layer, or its attached DSpark draft), the scheduler's draft policy `policy` (None: every
    draft verified)."""
    config = model.config
    limits = EngineLimits(4, 40, MAX_LEN, config.vocab_size, config.eos_token_ids, num_pages=num_pages,
                          block_tokens=BLOCK, prefix_snapshots=6)
    proposer = build_proposer(method, model, 4, MAX_LEN, drafts) if drafts else None
    runner = Recorder(ModelRunner(model, 4, MAX_LEN, num_pages=limits.total_pages, block_tokens=BLOCK,
                                  deterministic=True, snapshot_slots=6, draft_tokens=drafts, proposer=proposer))
    outputs = Outputs()
    scheduler = Scheduler(limits)
    if drafts:
        scheduler.spec_policy = policy
    engine = EngineCore(scheduler, runner, outputs, overlap=overlap)  # type: ignore[arg-type]
    steps = 0
    for wave in (requests, then):
        for request in wave:
            engine.submit(request)
        engine._drain_inbox(block=False)
        while scheduler.has_work or engine._in_flight is not None:
            if aborts and steps in aborts:
                engine.abort(aborts[steps])
                engine._drain_inbox(block=False)
            engine.step()
            steps += 1
            assert steps < 500, "the engine never ran out of work"
        scheduler.check_integrity()
    return outputs, runner, scheduler


def workload(stop_token: int | None = None) -> list[NewRequest]:
    shared = random_tokens(40, seed=3)  # a prefix several prompts start with (prefix-cache hits)
    greedy = dict(temperature=0.0, logprobs=0)
    requests = [
        NewRequest("long", random_tokens(90, seed=1), SamplingParams(max_tokens=14, ignore_eos=True, **greedy)),
        NewRequest("short", random_tokens(5, seed=2), SamplingParams(max_tokens=1, **greedy)),
        NewRequest("shared1", shared + random_tokens(7, seed=4), SamplingParams(max_tokens=9, ignore_eos=True, **greedy)),
        NewRequest("shared2", shared + random_tokens(12, seed=5), SamplingParams(max_tokens=11, ignore_eos=True,
                                                                                 **greedy)),
        NewRequest("seeded", random_tokens(30, seed=6), SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9,
                                                                       seed=11, ignore_eos=True, logprobs=0)),
        NewRequest("penalized", random_tokens(20, seed=7), SamplingParams(max_tokens=8, repetition_penalty=1.3,
                                                                          ignore_eos=True, **greedy)),
        NewRequest("victim", random_tokens(60, seed=8), SamplingParams(max_tokens=12, ignore_eos=True, **greedy)),
        NewRequest("late", shared + random_tokens(3, seed=9), SamplingParams(max_tokens=6, ignore_eos=True, **greedy)),
    ]
    if stop_token is not None:
        requests.append(NewRequest("stops", random_tokens(90, seed=1), SamplingParams(
            max_tokens=14, stop_token_ids=(stop_token,), **greedy)))
    return requests


@pytest.fixture(scope="module", params=["mixed", "v41"])
def model(request, checkpoints):
    """A tiny V4 and the tiny V4.1 (Engram on two layers: its rows hashed from the pending tokens)."""
    return load_model(checkpoints[request.param])


def test_overlapped_outputs_are_bitwise_the_serial_loops(model):
    serial, _, serial_scheduler = run(model, workload(), overlap=False)
    stop_token = serial.tokens("long")[4]  # "stops" repeats "long" and ends at this token
    requests = workload(stop_token)
    alone, _, _ = run(model, requests[-1:], overlap=False)  # deterministic mode: the same in any batch
    serial.by_request["stops"] = alone.by_request["stops"]
    overlapped, recorder, scheduler = run(model, requests, overlap=True)
    assert sum(PENDING_TOKEN in c.token_ids for p in recorder.plans for c in p.chunks) > 20, "steps did not overlap"
    for request in requests:
        rid = request.request_id
        assert overlapped.tokens(rid) == serial.tokens(rid), rid
        assert overlapped.logprobs(rid) == serial.logprobs(rid), rid
        assert overlapped.reason(rid) == serial.reason(rid), rid
        assert [o.finished for o in overlapped.by_request[rid]].count(True) == 1
    assert serial.reason("stops") == "stop" and serial.tokens("stops")[-1] == stop_token
    assert len(serial.tokens("stops")) < len(serial.tokens("long"))
    assert scheduler.num_preemptions and serial_scheduler.num_preemptions  # the pages ran out in both
    assert scheduler.blocks.stats().held == 0


def test_prefix_hits_under_overlap_resume_bitwise(model):
    """With pages to spare, later prompts resume from points taken while steps overlapped."""
    first, then = workload()[2:4], workload()[7:]  # "late" shares the first two's 40-token prefix
    serial, _, _ = run(model, first, overlap=False, num_pages=40, then=then)
    overlapped, _, scheduler = run(model, first, overlap=True, num_pages=40, then=then)
    assert scheduler.stats().prefix_hit_tokens >= 40
    for request in first + then:
        rid = request.request_id
        assert overlapped.tokens(rid) == serial.tokens(rid) and overlapped.logprobs(rid) == serial.logprobs(rid), rid


def test_aborts_while_a_step_is_in_flight_end_once_and_leave_the_others_exact(model):
    requests = workload()
    serial, _, _ = run(model, requests, overlap=False)
    aborts = {3: "long", 6: "victim", 9: "shared2"}
    overlapped, _, scheduler = run(model, requests, overlap=True, aborts=aborts)
    for request in requests:
        rid = request.request_id
        assert [o.finished for o in overlapped.by_request[rid]].count(True) == 1, rid
        tokens = overlapped.tokens(rid)
        if rid in aborts.values() and overlapped.reason(rid) == "abort":
            assert tokens == serial.tokens(rid)[: len(tokens)], rid  # what it got before the abort was exact
        else:
            assert tokens == serial.tokens(rid) and overlapped.logprobs(rid) == serial.logprobs(rid), rid
    assert sum(overlapped.reason(rid) == "abort" for rid in aborts.values()) >= 2
    assert scheduler.blocks.stats().held == 0 and not scheduler.launched and not scheduler.draining


class ScriptedDrafting(SpeculationPolicy):
    """The draft policy's decisions on a fixed schedule (the real one decides from measured step times):
    `pattern` cycles a step at a time (True: draft), a drafting step's chunks verify every draft."""

    def __init__(self, pattern: str) -> None:
        super().__init__(StepCost(), [], [])
        self.pattern, self.asked = pattern, 0
        self.observed: list[tuple[int, float]] = []

    def observe_step(self, rows: int, seconds: float) -> None:
        self.observed.append((rows, seconds))
        super().observe_step(rows, seconds)

    def drafting_next(self, batch: int) -> Drafting:
        self.asked += 1
        return Drafting.ON if self.pattern[self.asked % len(self.pattern)] == "d" else Drafting.OFF

    def draft_count(self, batch: int, proposed: int, probe: bool = False) -> int:
        return proposed


@pytest.mark.parametrize("method, pattern", [("mtp", "d.."), ("mtp", "d"), ("dspark", "d..")])
def test_speculating_overlaps_the_steps_that_draft_nothing(method, pattern, tmp_path):
    """Speculative decoding (K = 2: the MTP proposer on a tiny V4, DSpark on the tiny V4.1, whose Engram
    rows are hashed from the pending inputs) under overlapped scheduling: a step that verifies drafts or
    drafts next lands before the next is planned, the steps the policy has draft nothing overlap, their
    pending inputs resolved for the proposer; every request's tokens and logprobs are plain serial
    decoding's, bitwise (deterministic mode), through chunked prefill, preemption, prefix hits, a seeded
    sampler and a penalized request. "d": drafting every step, nothing overlaps."""
    from models.dspark import attach_dspark, build_tiny_dspark
    from models.random_model import build_random_model
    from models.tiny import build_tiny_checkpoint
    from tests.test_proposers import CONFIG

    if method == "mtp":
        model = build_random_model(CONFIG, torch.float32, "cpu", seed=2, mtp=True)
    else:
        target = build_tiny_checkpoint(tmp_path / "v41", seed=3)
        model = load_model(target)
        attach_dspark(model, build_tiny_dspark(tmp_path / "draft", target, seed=4, dspark_markov_rank=128))
    requests = workload()
    serial, _, _ = run(model, requests, overlap=False)
    policy = ScriptedDrafting(pattern)
    overlapped, recorder, scheduler = run(model, requests, overlap=True, drafts=2, method=method, policy=policy)
    for request in requests:
        rid = request.request_id
        assert overlapped.tokens(rid) == serial.tokens(rid), rid
        assert overlapped.logprobs(rid) == serial.logprobs(rid), rid
        assert [o.finished for o in overlapped.by_request[rid]].count(True) == 1
    pending = sum(PENDING_TOKEN in c.token_ids for p in recorder.plans for c in p.chunks)
    verified = sum(bool(c.draft_token_ids) for p in recorder.plans for c in p.chunks)
    assert verified > 5, "nothing was verified"
    assert (pending > 10) if pattern != "d" else pending == 0, pending
    for plan in recorder.plans:  # no chunk verifies drafts with an input in flight
        assert not any(c.draft_token_ids and PENDING_TOKEN in c.token_ids for c in plan.chunks)
    # the policy weighs every step that ran tokens, overlapped ones too, each at a positive cost
    assert [rows for rows, _ in policy.observed if rows] == [p.num_tokens for p in recorder.plans if p.num_tokens]
    assert all(seconds > 0 for rows, seconds in policy.observed if rows)
    assert scheduler.blocks.stats().held == 0
