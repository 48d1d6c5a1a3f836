"""The prefix cache's disk tier with tensor parallelism (docs/prefix-tiers.md): the engine as
engine/factory.py builds it, over two real rank processes on the CPU (gloo), deterministic. Each rank
keeps its own records in `<dir>/rank<r>/`, the catalog is the engine's; a point written as the first
engine stops is fetched by every rank after a restart, and a record corrupted on rank 1 alone fails
the fetch for both (the request recomputes). A pool restart reports the moves its old ranks had in
flight as failed.

Every engine runs in a process of its own, as it does when served (the engine process is rank 0): in
one process the first pool's rendezvous store (gloo, rank 0's TCPStore) outlives its close, and the
port free_port hands the second pool can be that store's, whose stale keys then break the second
rendezvous."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from contract import NewRequest, SamplingParams, StepPlan, StepResult
from contract.config import load_config
from engine.factory import build_engine_core
from engine.loop import EngineCore
from engram_store.format import PAGE
from models import ModelConfig
from scheduler.prefix_tiers import DiskEntry
from scheduler.scheduler import SchedulerStats
from tests.conftest import random_tokens
from tests.test_prefix_cache import Outputs, run
from tests.test_prefix_tiers_engine import close, flip_byte, same_as_cold
from worker.tensor_parallel import WorkerPool

PROMPTS = {"a": random_tokens(12, seed=1), "b": random_tokens(12, seed=2)}  # two conversations' first turns


@dataclass(frozen=True)
class Served:
    outputs: Outputs
    seeded: list[DiskEntry]  # the disk tier the catalog gave the engine
    entries: list[DiskEntry]  # the disk tier as the engine closed (what its catalog holds after a flush)
    stats: SchedulerStats
    record_pages: int  # disk pages of one page record


def serve(checkpoint: Path, directory: Path, script: Callable[[EngineCore, Outputs], None], flush: bool) -> Served:
    """In a fresh process: an engine of two ranks (one snapshot slot, the host and disk tiers in
    `directory`, seeded from its catalog) that runs `script` on this thread, then closes; with `flush`
    its loop thread is started and stopped as a server's is, which puts the GPU's points on disk (else
    the catalog stays as it was)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(_serve, checkpoint, directory, script, flush).result(timeout=120)


def _serve(checkpoint: Path, directory: Path, script: Callable[[EngineCore, Outputs], None], flush: bool) -> Served:
    overrides = [f"model.path={checkpoint}", "model.max_model_len=256", "runtime.device=cpu",
                 "runtime.deterministic=true", "parallel.tensor_parallel_size=2", "parallel.timeout_s=30",
                 "scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=16", "scheduler.prefix_snapshots=1",
                 "prefix_cache.host_gb=0.02", "prefix_cache.disk_gb=0.04", f"prefix_cache.dir={directory}"]
    outputs = Outputs()
    engine, _ = build_engine_core(load_config(None, overrides), outputs)
    seeded = engine.scheduler.disk_entries()
    try:
        script(engine, outputs)
        if flush:
            engine.start()
    finally:
        close(engine)
    return Served(outputs, seeded, engine.scheduler.disk_entries(), engine.scheduler.stats(),
                  engine.executor.runner.disk_tier.files[1].pages)


def turn2(vocab: int) -> SamplingParams:
    """Greedy, with every logprob of the vocabulary: equal entries mean equal logits."""
    return SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=vocab)


def follow_up(name: str, first: list[int]) -> list[int]:
    """A conversation's second prompt: its first, the two tokens drawn for it, five more."""
    return PROMPTS[name] + first + random_tokens(5, seed=3)


def first_turns(vocab: int, engine: EngineCore, outputs: Outputs) -> None:
    """Each conversation's first turn, then its second cold (under another salt: nothing to hit)."""
    for name, prompt in PROMPTS.items():
        run(engine, outputs, [NewRequest(name, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))])
    for name in PROMPTS:
        run(engine, outputs, [NewRequest(f"{name}2", follow_up(name, outputs.tokens(name)), turn2(vocab),
                                         cache_salt="cold")])


def second_turns(vocab: int, prompts: dict[str, list[int]], engine: EngineCore, outputs: Outputs) -> None:
    for name, prompt in prompts.items():
        run(engine, outputs, [NewRequest(f"{name}2", prompt, turn2(vocab))])


def test_a_restart_fetches_on_every_rank_and_a_record_bad_on_one_rank_fails_the_fetch(checkpoints, tmp_path):
    """The first engine's stop flushes both first turns' end points to disk. Conversation b's end point
    then gets a corrupted page record on rank 1 only. After a restart, a's second turn resumes from its
    end point on both ranks, bitwise the cold run (its tokens and every logprob of every draw); b's
    fetch fails on both ranks (rank 0's own record is intact) and its second turn recomputes, bitwise
    the cold run too."""
    model, directory = checkpoints["mixed"], tmp_path / "prefix"
    vocab = ModelConfig.from_file(model / "config.json").vocab_size
    cold = serve(model, directory, partial(first_turns, vocab), flush=True)
    assert cold.outputs.cached("a2") == cold.outputs.cached("b2") == 0
    assert all((directory / f"rank{r}" / name).exists() for r in (0, 1) for name in ("slots.bin", "pages.bin"))
    prompts = {name: follow_up(name, cold.outputs.tokens(name)) for name in PROMPTS}
    ends = {name: (None, tuple(prompt[:13])) for name, prompt in prompts.items()}  # first turn's prompt + token
    [bad] = [e for e in cold.entries if (e.salt, e.tokens) == ends["b"]]
    flip_byte(directory / "rank1" / "pages.bin", bad.pages[-1] * cold.record_pages * PAGE + 100)

    warm = serve(model, directory, partial(second_turns, vocab, prompts), flush=False)
    assert set(warm.seeded) == set(cold.entries) and {ends["a"], ends["b"]} <= {(e.salt, e.tokens) for e in warm.seeded}
    assert warm.outputs.cached("a2") == 13 and warm.outputs.cached("b2") < 13
    assert warm.stats.disk_hit_tokens == 13 + warm.outputs.cached("b2") and warm.stats.fetch_failures == 1
    for rid in ("a2", "b2"):
        same_as_cold(warm.outputs, cold.outputs, rid)


class InFlight:
    """A rank's runner that runs nothing, with disk tier move 7 in flight."""

    pending_inputs = False
    proposes_drafts = False

    def __init__(self) -> None:
        self.cache, self.tickets = SimpleNamespace(num_pages=4), SimpleNamespace(in_flight={7: None})

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(chunks=())

    def close(self) -> None:
        pass


def in_flight(plan_group=None, num_pages=None) -> tuple[InFlight, None]:
    return InFlight(), None


def test_a_pool_restart_reports_the_moves_its_ranks_had_in_flight_failed():
    """Else the scheduler waits forever for their TierDone (an idle engine with tickets out has work)
    and keeps the host rows and disk records they pin. The pool runs rank 0 in this process, which sets
    RANK / WORLD_SIZE / MASTER_* in its environment: they are put back after, or every server a later
    test starts would take itself for a torchrun rank."""
    config = load_config(None, ["parallel.tensor_parallel_size=2", "runtime.device=cpu", "parallel.timeout_s=30"])
    environment = dict(os.environ)
    pool = WorkerPool(config, in_flight, "cpu")
    try:
        os.kill(pool.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pool.health() is None and time.monotonic() < deadline:  # the watchdog sees the rank exit
            time.sleep(0.05)
        assert pool.maintain() is True  # rebuilt: the engine loop drops what the old ranks held
        assert pool.maintain() is False
        [lost] = pool.execute(StepPlan(chunks=())).tier_done
        assert lost.ticket == 7 and "lost with the tensor-parallel ranks: tensor-parallel rank 1" in lost.error
        assert pool.execute(StepPlan(chunks=())).tier_done == () and pool.restarts == 1
    finally:
        pool.close()
        os.environ.clear()
        os.environ.update(environment)
