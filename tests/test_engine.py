"""The engine loop with the real model: continuous batching, chunked prefill, rejection, abort."""

from __future__ import annotations

import threading

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
