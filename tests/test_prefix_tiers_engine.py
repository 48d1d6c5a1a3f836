"""The prefix cache's host and disk tiers through the engine (docs/prefix-tiers.md): EngineCore, the
Scheduler and a real ModelRunner on the tiny checkpoints, real record files. In deterministic mode a
follow-up whose hit is loaded from the host tier, or fetched from the disk tier after a restart, gives
bitwise the cold run (its tokens, and every vocabulary logprob of every draw); a corrupted disk record
makes it recompute, still bitwise. Stopping flushes the GPU's points to the disk tier, so a restart
finds the turn that was never evicted; a flush that cannot finish ends at its deadline, and a loop
that died does not flush. The tiers' figures reach EngineStats, the wire and /metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from contract import (
    DoneStep,
    EngineLimits,
    EngineStats,
    NewRequest,
    PrefixTierLimits,
    SamplingParams,
    StepPlan,
    StepResult,
)
from contract.codec import decode, encode
from engine.loop import EngineCore
from engine.prefix_catalog import CatalogWriter, Fingerprint, load_catalog
from engram_store.format import PAGE
from models import load_model
from scheduler import Scheduler
from server.metrics import prefix_tier_figures
from tests.conftest import random_tokens
from tests.test_prefix_cache import Outputs, full_logprobs, run
from tests.test_prefix_tiers_scheduler import Worker, make_limits, params, serve, tokens
from worker import ModelRunner

BLOCK = 16
MAX_LEN = 96
SEQS = 2
# one snapshot slot, so each new point evicts the last one into the host tier (which holds them all)
TIERS = PrefixTierLimits(host_slots=8, host_pages=24, disk_slots=16, disk_pages=48)
FINGERPRINT = Fingerprint.of({"test": "prefix tiers through the engine"})


@dataclass(frozen=True)
class Setup:
    checkpoint: str
    kv_cache_dtype: str = "auto"
    kv_hot_tokens: int | None = None  # the KV host tier: each running sequence's last tokens' pages on the GPU


# V4 plain; V4.1 with its plain cache; V4.1 with packed fp4 pages in the KV host tier (a GPU ring of 16 tokens)
SETUPS = [Setup("mixed"), Setup("v41"), Setup("v41", "fp4", kv_hot_tokens=16)]


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: load_model(checkpoints[name]) for name in {s.checkpoint for s in SETUPS}}


def make_engine(model, setup: Setup, directory: Path | None = None) -> tuple[EngineCore, Outputs]:
    """Deterministic. With `directory`: one snapshot slot, the host tier, and the disk tier in `directory`
    seeded from its catalog as a restart is (engine/factory.py); the engine writes the catalog as it stops."""
    tiers = TIERS if directory is not None else PrefixTierLimits()
    snapshots = 1 if directory is not None else 0
    limits = EngineLimits(SEQS, 64, MAX_LEN, model.config.vocab_size, model.config.eos_token_ids, block_tokens=BLOCK,
                          prefix_snapshots=snapshots, prefix_tiers=tiers)
    runner = ModelRunner(model, SEQS, MAX_LEN, num_pages=limits.total_pages, block_tokens=BLOCK, deterministic=True,
                         snapshot_slots=snapshots, kv_cache_dtype=setup.kv_cache_dtype,
                         kv_hot_tokens=setup.kv_hot_tokens, prefix_tiers=tiers, prefix_dir=directory)
    scheduler = Scheduler(limits)
    catalog = None
    if directory is not None:
        scheduler.seed_disk(load_catalog(directory, FINGERPRINT))
        catalog = CatalogWriter(directory, FINGERPRINT, scheduler.disk_version)
    outputs = Outputs()
    return EngineCore(scheduler, runner, outputs, catalog=catalog), outputs


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def close(engine: EngineCore) -> None:
    engine.stop()
    engine.executor.close()


def same_as_cold(warm: Outputs, cold: Outputs, rid: str) -> None:
    assert warm.tokens(rid) == cold.tokens(rid)
    assert warm.logprobs(rid) == cold.logprobs(rid)  # every logprob of the vocabulary, every draw, bitwise


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s.checkpoint}-{s.kv_cache_dtype}-hot{s.kv_hot_tokens}")
def test_host_and_disk_hits_are_bitwise_the_cold_run_and_stop_flushes_the_gpu_points(models, tmp_path, setup):
    """Turn 1 (`a`), an unrelated request (its point evicts turn 1's end point into the host tier), turn 2
    (`f`: a host hit), stop; after a restart turn 3 (`g`) resumes from turn 2's end point, which only the
    flush put on disk; with that point's own last page corrupted, turn 3 fetches the shorter point at
    turn 2's prompt instead. Every turn draws three times (a prefill and two decode steps)."""
    model = models[setup.checkpoint]
    directory = tmp_path / "prefix"
    directory.mkdir()
    engine, warm = make_engine(model, setup, directory)
    prompt = random_tokens(12, seed=1)
    run(engine, warm, [NewRequest("a", prompt, greedy(2))])
    run(engine, warm, [NewRequest("other", random_tokens(6, seed=2), greedy(1))])
    follow_up = prompt + warm.tokens("a") + random_tokens(5, seed=3)  # 19 tokens: resumes at 13
    run(engine, warm, [NewRequest("f", follow_up, full_logprobs(model, 3))])
    stats = engine.scheduler.stats()
    assert warm.cached("f") == stats.host_hit_tokens == 13 and stats.disk_hit_tokens == 0
    end = (None, tuple(follow_up + warm.tokens("f")[:-1]))  # turn 2's end point (21 tokens): on the GPU only
    assert end in engine.scheduler.prefix.points
    assert end not in engine.scheduler.tiers.host.points and end not in engine.scheduler.tiers.disk.points
    engine.start()  # the loop thread, to stop it as a server does (the steps above ran on this thread)
    close(engine)
    entries = load_catalog(directory, FINGERPRINT)
    assert set(entries) == set(engine.scheduler.disk_entries())
    assert end in {(e.salt, e.tokens) for e in entries}

    third = follow_up + warm.tokens("f") + random_tokens(2, seed=4)  # 24 tokens
    cold_engine, cold = make_engine(model, setup)  # no prefix cache
    run(cold_engine, cold, [NewRequest("f", follow_up, full_logprobs(model, 3)),
                            NewRequest("g", third, full_logprobs(model, 3))])
    same_as_cold(warm, cold, "f")
    close(cold_engine)

    engine, warm = make_engine(model, setup, directory)  # restarted: the host tier is empty
    run(engine, warm, [NewRequest("g", third, full_logprobs(model, 3))])
    stats = engine.scheduler.stats()
    assert warm.cached("g") == stats.disk_hit_tokens == 21 and stats.fetch_failures == 0
    same_as_cold(warm, cold, "g")
    record_pages = engine.executor.disk_tier.files[1].pages
    close(engine)  # never started, so it leaves the catalog as it was

    [point] = [e for e in entries if (e.salt, e.tokens) == end]
    flip_byte(directory / "rank0" / "pages.bin", point.pages[-1] * record_pages * PAGE + 100)  # its own last page
    engine, warm = make_engine(model, setup, directory)
    run(engine, warm, [NewRequest("g", third, full_logprobs(model, 3))])
    stats = engine.stats()
    assert stats.prefix_fetch_failures == 1 and warm.cached("g") == stats.prefix_disk_hits == 19  # turn 2's prompt
    same_as_cold(warm, cold, "g")
    assert (stats.prefix_gpu_points, stats.prefix_host_points, stats.prefix_disk_points) == (
        1, engine.scheduler.stats().host_points, engine.scheduler.stats().disk_points)
    assert decode(encode(stats)) == stats
    close(engine)


def test_the_tiers_figures_reach_metrics():
    stats = EngineStats(running=0, waiting=0, prefix_cache_hits=100, prefix_gpu_points=3, prefix_host_points=5,
                        prefix_disk_points=9, prefix_host_hits=30, prefix_disk_hits=50, prefix_fetch_failures=2)

    class Families:
        def collect(self):
            return list(prefix_tier_figures(stats, ["tiny", "0"]))

    registry = CollectorRegistry()
    registry.register(Families())
    text = generate_latest(registry).decode()
    labels = 'engine="0",model_name="tiny"'
    for tier, points, hits in (("gpu", 3, 20), ("host", 5, 30), ("disk", 9, 50)):
        assert f'ds4serve:prefix_cache_points{{{labels},tier="{tier}"}} {float(points)}' in text
        assert f'ds4serve:prefix_cache_hits_by_tier_total{{{labels},tier="{tier}"}} {float(hits)}' in text
    assert f"ds4serve:prefix_cache_fetch_failures_total{{{labels}}} 2.0" in text
    assert decode(encode(stats)) == stats


# -- the flush on the model of the bytes (tests/test_prefix_tiers_scheduler.py's Worker) ------------------

def flush(scheduler: Scheduler, worker: Worker) -> list[StepPlan]:
    """Runs the scheduler's flush plans to the end, as the stopping loop does; the plans."""
    plans = []
    while (plan := scheduler.flush()) is not None:
        plans.append(plan)
        scheduler.update(plan, worker.execute(plan))
        scheduler.check_integrity()
    return plans


def test_the_flush_goes_in_rounds_the_host_tier_takes_and_leaves_running_requests_alone():
    """Three GPU points through a one-slot host tier: one spill a round, each written before the next;
    a request still running keeps its slot and pages; a restart serves every point exactly."""
    limits = make_limits(snapshots=3, host=(1, 8), disk=(8, 32))
    scheduler = Scheduler(limits)
    worker = Worker(scheduler, auto=1.0)
    prompts = [tokens(6 + i, seed=100 + i) for i in range(2)]
    for i, prompt in enumerate(prompts):
        serve(worker, NewRequest(f"r{i}", prompt, params(2)))
    scheduler.add(NewRequest("running", tokens(9, seed=110), params(20)))
    for _ in range(3):
        worker.step()
    points = set(scheduler.prefix.points)
    assert len(points) == 3 and not points & on_disk(scheduler)
    held = scheduler.blocks.stats().held
    plans = flush(scheduler, worker)
    assert [len([m for m in p.tier_moves if m.kind == "spill"]) for p in plans] == [1, 1, 1]
    assert all(not p.chunks for p in plans) and scheduler.unflushed() == 0
    assert [r.request_id for r in scheduler.running] == ["running"] and scheduler.blocks.stats().held == held
    assert points <= on_disk(scheduler)

    restarted = Scheduler(limits)
    restarted.seed_disk(scheduler.disk_entries())
    again = Worker(restarted, disk=worker.disk, auto=1.0)  # checks every state it resumes from
    for i, (salt, point) in enumerate(points):
        serve(again, NewRequest(f"again{i}", point + (5,), params(), cache_salt=salt))
    assert restarted.stats().disk_hit_tokens == sum(len(point) for _, point in points)


def on_disk(scheduler: Scheduler) -> set:
    return {(e.salt, e.tokens) for e in scheduler.disk_entries()}


class Executor:
    """The loop's executor over the Worker (its `maintain` may fail: the loop dies); counts its steps."""

    pending_inputs = False
    proposes_drafts = False

    def __init__(self, worker: Worker, fails: bool = False) -> None:
        self.worker, self.fails, self.steps = worker, fails, 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        return self.worker.execute(plan)

    def launch(self, plan: StepPlan) -> DoneStep:
        return DoneStep(self.execute(plan))

    def maintain(self) -> None:
        if self.fails:
            raise RuntimeError("the pool is gone")


def served(fails: bool = False) -> tuple[Scheduler, Worker, Executor]:
    """A scheduler with a GPU point not on disk, and an executor whose disk writes never finish."""
    scheduler = Scheduler(make_limits(snapshots=1, disk=(4, 16)))
    worker = Worker(scheduler, auto=1.0)
    serve(worker, NewRequest("r", tokens(10, seed=120), params()))
    worker.auto = None
    return scheduler, worker, Executor(worker, fails)


def test_a_flush_whose_writes_never_finish_ends_at_its_deadline(caplog):
    scheduler, _, executor = served()
    [end] = scheduler.prefix.points
    engine = EngineCore(scheduler, executor, lambda outputs: None, flush_s=0.2)  # type: ignore[arg-type]
    engine.start()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ds4serve.engine"):
        engine.stop()
    assert 0.2 <= time.monotonic() - started < 2 and not engine.alive and executor.steps > 0
    assert "1 state points not on disk when the 0.2 s flush ended" in caplog.text
    assert end not in on_disk(scheduler)


def test_a_loop_that_died_does_not_flush():
    scheduler, _, executor = served(fails=True)
    engine = EngineCore(scheduler, executor, lambda outputs: None)  # type: ignore[arg-type]
    engine.start()
    engine.stop()
    assert engine.failure == "RuntimeError: the pool is gone" and executor.steps == 0
