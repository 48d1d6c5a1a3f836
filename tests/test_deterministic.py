"""Deterministic mode: bitwise the same outputs whatever the batch composition, prefill chunking or
preemption; default mode stays within the oracle bounds under the same pressure."""

from __future__ import annotations

import threading

import pytest
import torch

from contract import EngineLimits, NewRequest, SamplingParams
from engine.loop import EngineCore
from models import ForwardBatch, ModelCache, load_model
from scheduler import Scheduler
from tests.conftest import random_tokens
from worker import ModelRunner

MAX_LEN = 160


class Collector:
    def __init__(self, expected: int) -> None:
        self.outputs: dict[str, list] = {}
        self.finished, self.expected = 0, expected
        self.done = threading.Event()

    def __call__(self, outputs) -> None:  # one engine step's outputs
        for output in outputs:
            self.outputs.setdefault(output.request_id, []).append(output)
            self.finished += output.finished
            if self.finished == self.expected:
                self.done.set()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list[float]:
        return [lp.logprob for o in self.outputs[rid] for lp in o.new_logprobs]


def serve(model, requests, *, max_num_seqs, budget, num_pages=None, deterministic=True):
    limits = EngineLimits(
        max_num_seqs, budget, MAX_LEN, model.config.vocab_size, model.config.eos_token_ids,
        num_pages=num_pages, block_tokens=16,
    )
    runner = ModelRunner(model, max_num_seqs, MAX_LEN, num_pages=limits.total_pages, block_tokens=16,
                         deterministic=deterministic)
    collector = Collector(len(requests))
    engine = EngineCore(Scheduler(limits), runner, collector)
    engine.start()
    for request in requests:
        engine.submit(request)
    assert collector.done.wait(300), "engine did not finish"
    engine.stop()
    engine.scheduler.check_integrity()
    return collector, engine.scheduler


def workload(seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """16 requests of mixed prompt lengths, greedy except two seeded samplers."""
    out = {}
    for i in range(16):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
        if i in (3, 11):
            params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True, logprobs=0)
        out[f"r{i}"] = (random_tokens(5 + (i * 37) % 90, seed=seed + i), params)
    return out


@pytest.mark.parametrize("name", ["mixed", "v41"])
def test_crowded_chunked_preempted_outputs_are_bitwise_the_solo_outputs(checkpoints, name):
    model = load_model(checkpoints[name])
    requests = workload(seed=40)
    # one slot: each request runs alone, one after another (no prefix cache: nothing carries over)
    alone, _ = serve(model, [NewRequest(rid, p, params) for rid, (p, params) in requests.items()], max_num_seqs=1,
                     budget=512)
    solo = {rid: (alone.tokens(rid), alone.logprobs(rid)) for rid in requests}
    # 16 at once: 6 slots, 40-token steps (chunked prefill), pages for ~2.5 long sequences (preemption)
    crowded, scheduler = serve(
        model, [NewRequest(rid, p, params) for rid, (p, params) in requests.items()], max_num_seqs=6, budget=40, num_pages=18
    )
    assert scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    for rid in requests:
        assert crowded.tokens(rid) == solo[rid][0], rid
        assert crowded.logprobs(rid) == solo[rid][1], rid  # bitwise, not approximately


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    return model(ForwardBatch.build([(0, ids, 0)], logits="all"), ModelCache.allocate(model.config, 1, MAX_LEN))


def test_default_mode_under_pressure_stays_on_the_argmax(checkpoints):
    """V4, default mode: every greedy token is within 1e-4 of the teacher-forced maximum."""
    model = load_model(checkpoints["mixed"])
    requests = {rid: (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for rid, (p, _) in workload(seed=70).items()}
    crowded, scheduler = serve(
        model, [NewRequest(rid, p, params) for rid, (p, params) in requests.items()], max_num_seqs=6, budget=40,
        num_pages=18, deterministic=False,
    )
    assert scheduler.num_preemptions > 0
    for rid, (prompt, _) in requests.items():
        generated = crowded.tokens(rid)
        logits = teacher_forced(model, prompt + generated)
        for step, token in enumerate(generated):
            row = logits[len(prompt) - 1 + step]
            assert row[token] >= row.max() - 1e-4, (rid, step)


def test_default_mode_v41_prompt_logprobs_stay_within_the_golden_bounds(checkpoints):
    model = load_model(checkpoints["v41"])
    requests = {rid: (p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
                for rid, (p, _) in workload(seed=90).items()}
    crowded, scheduler = serve(
        model, [NewRequest(rid, p, params) for rid, (p, params) in requests.items()], max_num_seqs=6, budget=40,
        num_pages=18, deterministic=False,
    )
    deviations = []
    for rid, (prompt, _) in requests.items():
        served = next(o.prompt_logprobs for o in crowded.outputs[rid] if o.prompt_logprobs is not None)
        expected = teacher_forced(model, prompt).log_softmax(-1)
        deviations += [abs(served[i].logprob - expected[i - 1, prompt[i]].item()) for i in range(1, len(prompt))]
    deviations = torch.tensor(deviations)
    assert deviations.median() <= 1e-3 and deviations.quantile(0.95) <= 1e-2
