"""The engine loop with the real model: continuous batching, chunked prefill, rejection, abort."""

from __future__ import annotations

import threading
import time

import pytest

from contract import EngineLimits, NewRequest, RequestRejected, SamplingParams
from engine.loop import EngineCore
from models import load_model
from scheduler import Scheduler
from tests.conftest import random_tokens
from worker import ModelRunner


class Collector:
    def __init__(self, expected: int) -> None:
        self.outputs: dict[str, list] = {}
        self.finished = 0
        self.expected = expected
        self.done = threading.Event()

    def __call__(self, outputs) -> None:  # one engine step's outputs
        for output in outputs:
            self.outputs.setdefault(output.request_id, []).append(output)
            if output.finished:
                self.finished += 1
                if self.finished == self.expected:
                    self.done.set()

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]


def run(model, requests: list[NewRequest], max_num_seqs: int, budget: int) -> tuple[Collector, EngineCore]:
    limits = EngineLimits(max_num_seqs, budget, 256, model.config.vocab_size, model.config.eos_token_ids)
    collector = Collector(len(requests))
    runner = ModelRunner(model, max_num_seqs, 256, num_pages=limits.total_pages, block_tokens=limits.block_tokens)
    engine = EngineCore(Scheduler(limits), runner, collector)
    engine.start()
    for request in requests:
        engine.submit(request)
    assert collector.done.wait(120), "engine did not finish"
    engine.stop()
    return collector, engine


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints["mixed"])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_chunked_prefill_and_crowding_do_not_change_greedy_tokens(model):
    prompts = {f"r{i}": random_tokens(20 + 17 * i, seed=i) for i in range(6)}

    def requests():
        return [NewRequest(rid, ids, greedy(10)) for rid, ids in prompts.items()]

    alone = {rid: run(model, [NewRequest(rid, ids, greedy(10))], 1, 1024)[0].tokens(rid) for rid, ids in prompts.items()}
    crowded, engine = run(model, requests(), max_num_seqs=3, budget=24)  # 6 requests, 3 slots, tiny chunks
    for rid in prompts:
        assert crowded.tokens(rid) == alone[rid], rid
    assert engine.steps > 10
    engine.scheduler.check_integrity()


def test_requests_longer_than_max_model_len_are_refused(model):
    limits = EngineLimits(2, 64, 100, model.config.vocab_size, (1,))
    scheduler = Scheduler(limits)
    with pytest.raises(RequestRejected, match="maximum context length is 100"):
        scheduler.validate(NewRequest("x", list(range(3, 93)), greedy(20)))
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.validate(NewRequest("y", [], greedy(2)))


def test_abort_frees_the_slot(model):
    limits = EngineLimits(1, 64, 256, model.config.vocab_size, (1,))
    scheduler = Scheduler(limits)
    scheduler.add(NewRequest("a", random_tokens(10, 1), greedy(50)))
    scheduler.add(NewRequest("b", random_tokens(10, 2), greedy(5)))
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["a"]
    output = scheduler.abort("a")
    assert output.finished and output.finish_reason == "abort"
    assert [c.request_id for c in scheduler.schedule().chunks] == ["b"]
    scheduler.check_integrity()


class RebuiltRunner(ModelRunner):
    """A runner whose state is rebuilt once on request (as a tensor-parallel pool's watchdog restart
    does to an idle engine): its cache is zeroed and maintain() says so."""

    rebuild = False

    def maintain(self) -> bool:
        if not self.rebuild:
            return False
        self.rebuild = False
        for tensor in self.cache.tensors():
            tensor.zero_()
        return True


def test_a_rebuilt_executor_drops_the_prefix_points_its_old_state_held(model):
    """After a rebuild no hit may restore the zeroed snapshots: the follow-up recomputes and gives the
    tokens of a run that never had a cache."""
    limits = EngineLimits(2, 64, 256, model.config.vocab_size, model.config.eos_token_ids, prefix_snapshots=4)
    runner = RebuiltRunner(model, 2, 256, num_pages=limits.total_pages, block_tokens=limits.block_tokens,
                           snapshot_slots=4)
    prompt = random_tokens(40, seed=5)
    collector = Collector(3)
    engine = EngineCore(Scheduler(limits), runner, collector)
    engine.start()
    engine.submit(NewRequest("first", prompt, greedy(4)))
    while not collector.finished:
        time.sleep(0.01)
    assert engine.scheduler.stats().prefix_points > 0
    runner.rebuild = True
    deadline = time.monotonic() + 10
    while engine.scheduler.stats().prefix_points and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.scheduler.stats().prefix_points == 0
    engine.submit(NewRequest("again", prompt + [7], greedy(4)))
    engine.submit(NewRequest("cold", prompt + [7], greedy(4), cache_salt="other"))
    assert collector.done.wait(60)
    engine.stop()
    assert collector.tokens("again") == collector.tokens("cold")
    assert engine.scheduler.stats().prefix_hit_tokens == 0
