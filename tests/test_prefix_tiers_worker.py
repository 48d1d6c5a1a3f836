"""The prefix cache's host and disk tiers in the worker (worker/prefix_tiers.py): a state point spilled to
host, written to disk, fetched back into other host rows and loaded into another slot decodes bitwise
like the original; a damaged, stale or never-written record fails its fetch (naming it) and leaves the
host rows alone; a plan waiting only on the disk tier waits a bounded time. Real files, the real
io_uring reader, the tiny models on the CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from contract import (
    PrefixTierLimits,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TierDone,
    TierMove,
)
from engram_store.format import PAGE
from models import load_model
from tests.conftest import random_tokens
from worker import ModelRunner
from worker.prefix_tiers import (
    PAYLOAD,
    Tickets,
    disk_record_pages,
    page_record_bytes,
    slot_record_bytes,
)

BLOCK = 16
MAX_LEN = 64  # 4 pages a slot
PROMPT = random_tokens(45, seed=3)  # 3 pages, the last one partial
GREEDY = SamplingParams(temperature=0.0)
TIERS = PrefixTierLimits(host_slots=3, host_pages=8, disk_slots=3, disk_pages=8)
SEALS = (0x5EA1_0001, 0x5EA1_0002, 0x5EA1_0003, 0x5EA1_0004)  # the slot record's, then each page's


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: load_model(checkpoints[name]) for name in ("mixed", "v41")}


def make_runner(model, directory, kv_cache_dtype: str = "auto", kv_hot_tokens: int | None = None,
                device: str = "cpu") -> ModelRunner:
    """Two request slots and a snapshot slot (so the runner keeps last logits), every slot its own pages. Eager
    and not batch-invariant: each slot decodes alone in its step, so equal state gives bitwise equal logits."""
    return ModelRunner(model, 2, MAX_LEN, device=device, block_tokens=BLOCK, snapshot_slots=1,
                       kv_cache_dtype=kv_cache_dtype, kv_hot_tokens=kv_hot_tokens, prefix_tiers=TIERS,
                       prefix_dir=directory)


def pages_of(runner: ModelRunner, slot: int) -> tuple[int, ...]:
    return tuple(runner.cache.default_pages(slot).tolist())


def step(runner: ModelRunner, slot: int, tokens: list[int], position: int) -> StepResult:
    chunk = ScheduledChunk(request_id=f"slot{slot}", slot=slot, pages=pages_of(runner, slot), token_ids=tuple(tokens),
                           position=position, sample=True, logprob_targets=(), params=GREEDY, num_generated=0)
    return runner.execute(StepPlan((chunk,)))


def moves(runner: ModelRunner, *tier_moves: TierMove) -> None:
    assert runner.execute(StepPlan((), tier_moves=tier_moves)).chunks == ()


def finish(runner: ModelRunner, ticket: int) -> TierDone:
    """Empty plans with the ticket out until its TierDone arrives (each waits a few ms: see the bounded wait's test)."""
    for _ in range(1000):
        done = runner.execute(StepPlan((), tickets_out=1)).tier_done
        if done:
            assert [d.ticket for d in done] == [ticket]
            return done[0]
    raise AssertionError(f"ticket {ticket} never finished")


def host_rows(runner: ModelRunner) -> list[torch.Tensor]:
    return [m.host.clone() for m in runner.host_tier.fixed + runner.host_tier.paged]


@pytest.mark.parametrize("name,kv_cache_dtype,kv_hot_tokens", [
    ("mixed", "auto", None),  # V4: sliding, CSA and HCA layers
    ("v41", "fp4", None),  # V4.1, packed FP4 pages, Engram look-back
    ("v41", "fp4", 16),  # and the KV host tier: a loaded page the GPU ring holds must be re-copied
])
def test_spill_write_fetch_load_round_trip_is_bitwise(models, tmp_path, name, kv_cache_dtype, kv_hot_tokens):
    check_round_trip(models[name], tmp_path, kv_cache_dtype, kv_hot_tokens)


def check_round_trip(model, directory, kv_cache_dtype: str = "auto", kv_hot_tokens: int | None = None,
                     device: str = "cpu") -> None:
    """A point spilled to host and written to disk in one plan, fetched into other host rows and loaded into
    another slot: the same bytes there, and decode steps bitwise those of the original. On "cuda" (tests/test_gpu.py)
    the spills and loads are copy kernels through the mapped pinned host rows, and the disk threads wait
    on the CUDA events recorded after the plan's spills."""
    runner = make_runner(model, directory, kv_cache_dtype, kv_hot_tokens, device)
    src, dst = pages_of(runner, 0), pages_of(runner, 1)
    step(runner, 1, random_tokens(40, seed=4), 0)  # the target slot and pages hold other state (and are hot)
    step(runner, 0, PROMPT, 0)
    host_pages, disk_pages, fetched_pages = (5, 1, 7), (3, 0, 6), (2, 3, 4)
    moves(runner,
          TierMove("spill", (0, 2), tuple(zip(src, host_pages))),
          TierMove("write", (2, 1), tuple(zip(host_pages, disk_pages)), SEALS, ticket=1))  # in the same plan
    assert finish(runner, 1) == TierDone(1)
    moves(runner, TierMove("fetch", (1, 0), tuple(zip(disk_pages, fetched_pages)), SEALS, ticket=2))
    assert finish(runner, 2) == TierDone(2)
    moves(runner, TierMove("load", (0, 1), tuple(zip(fetched_pages, dst))))

    assert torch.equal(runner.last_logits[1], runner.last_logits[0])  # part of the point: drawn from if all cached
    for mirror in runner.host_tier.fixed:
        assert torch.equal(mirror.cache[1], mirror.cache[0])
    for mirror in runner.host_tier.paged:
        assert torch.equal(mirror.cache[list(dst[:3])], mirror.cache[list(src[:3])])
    for position, token in enumerate(random_tokens(5, seed=5), start=len(PROMPT)):  # on into the 4th page
        logits = []
        for slot in (0, 1):
            step(runner, slot, [token], position)
            logits.append(runner.last_logits[slot].clone())
        assert torch.equal(logits[0], logits[1])
    runner.close()


@dataclass(frozen=True)
class Damage:
    move: TierMove
    where: str  # what the error must name
    why: str
    bad_pages: tuple[int, ...]  # the page records TierDone names as failed


def test_a_damaged_stale_or_unwritten_record_fails_its_fetch(models, tmp_path):
    runner = make_runner(models["mixed"], tmp_path)
    step(runner, 0, PROMPT, 0)
    moves(runner, TierMove("spill", (0, 0), tuple(zip(pages_of(runner, 0), (0, 1, 2)))),
          TierMove("write", (0, 0), ((0, 0), (1, 1), (2, 2)), SEALS, ticket=1))
    assert finish(runner, 1) == TierDone(1)
    page_pages = runner.disk_tier.files[1].pages
    with open(tmp_path / "rank0" / "pages.bin", "r+b") as pages_file:  # one byte of disk page record 1
        pages_file.seek(page_pages * PAGE + 100)
        byte = pages_file.read(1)[0]
        pages_file.seek(page_pages * PAGE + 100)
        pages_file.write(bytes([byte ^ 0x10]))
    before = host_rows(runner)
    cases = [
        Damage(TierMove("fetch", (0, 1), ((0, 3), (1, 4)), SEALS[:3], ticket=2), "pages.bin record 1", "checksum mismatch",
               (1,)),
        Damage(TierMove("fetch", (0, 1), ((0, 3),), (0xBAD, SEALS[1]), ticket=3), "slots.bin record 0 (page 0)",
               "stale seal 0x5ea10001", ()),
        Damage(TierMove("fetch", (2, 1), (), (SEALS[0],), ticket=4), "slots.bin record 2", "never written", ()),
    ]
    for case in cases:
        moves(runner, case.move)
        done = finish(runner, case.move.ticket)
        assert done.error is not None and case.where in done.error and case.why in done.error, done.error
        assert done.bad_pages == case.bad_pages  # the page records that failed, for the scheduler to drop
        assert str(tmp_path / "rank0") in done.error
    assert all(torch.equal(a, b) for a, b in zip(before, host_rows(runner)))  # no row of a failed fetch was written
    moves(runner, TierMove("fetch", (0, 1), ((0, 3), (2, 4)), (SEALS[0], SEALS[1], SEALS[3]), ticket=5))
    assert finish(runner, 5) == TierDone(5)  # the sound records still read
    threads = list(runner.disk_tier._threads)
    runner.close()
    assert len(threads) == 2 and not any(t.is_alive() for t in threads)


def test_a_plan_waiting_on_the_disk_tier_waits_briefly_not_forever(models, tmp_path):
    runner = make_runner(models["mixed"], tmp_path)
    started = time.perf_counter()
    assert runner.execute(StepPlan((), tickets_out=1)).tier_done == ()  # nothing in flight: one bounded wait
    waited = time.perf_counter() - started
    assert 0.004 <= waited < 0.5
    started = time.perf_counter()
    assert runner.execute(StepPlan(())).tier_done == ()  # no tickets out: no wait at all
    assert time.perf_counter() - started < 0.004
    moves(runner, TierMove("fetch", (0, 0), (), (SEALS[0],), ticket=9))  # never written: fails, but finishes
    started = time.perf_counter()
    done = runner.execute(StepPlan((), tickets_out=1)).tier_done
    while not done:
        assert time.perf_counter() - started < 2
        done = runner.execute(StepPlan((), tickets_out=1)).tier_done
    assert [d.ticket for d in done] == [9] and "never written" in done[0].error
    runner.close()
    runner.close()  # twice is fine


def test_record_sizes_and_files_follow_the_budget_functions(models, tmp_path):
    runner = make_runner(models["v41"], tmp_path)
    vocab = runner.model.config.vocab_size
    slot_bytes, page_bytes = slot_record_bytes(runner.cache, vocab), page_record_bytes(runner.cache)
    assert slot_bytes == sum(m.row_bytes for m in runner.host_tier.fixed)
    assert slot_bytes - slot_record_bytes(runner.cache, None) == 4 * vocab
    assert page_bytes == sum(m.row_bytes for m in runner.host_tier.paged) == runner.cache.page_bytes()
    assert (disk_record_pages(PAYLOAD), disk_record_pages(PAYLOAD + 1)) == (1, 2)
    for path, records, nbytes in (("slots.bin", TIERS.disk_slots, slot_bytes), ("pages.bin", TIERS.disk_pages, page_bytes)):
        assert (tmp_path / "rank0" / path).stat().st_size == records * disk_record_pages(nbytes) * PAGE
    runner.close()


class TwoRanks:
    """Tickets' group: this rank and another, which has finished `finished` (ticket -> it failed)."""

    world_size = 2

    def __init__(self) -> None:
        self.finished: dict[int, bool] = {}
        self.tickets: Tickets | None = None

    def all_reduce(self, flags: torch.Tensor) -> torch.Tensor:
        for column, ticket in enumerate(self.tickets.in_flight):
            if ticket in self.finished:
                flags[0, column] += 1
                flags[1, column] += int(self.finished[ticket])
        return flags


def test_a_move_is_reported_once_every_rank_finished_it():
    group = TwoRanks()
    group.tickets = tickets = Tickets(group, "cpu")
    tickets.issue([TierMove("write", (0, 0), seals=(1,), ticket=t) for t in (7, 8, 9)])
    group.finished = {7: True, 9: False}
    assert tickets.finish([TierDone(7), TierDone(8)]) == (TierDone(7, "the move failed on another tensor-parallel rank"),)
    group.finished[8] = False
    assert tickets.finish([]) == (TierDone(8),)
    assert tickets.finish([TierDone(9, "bad")]) == (TierDone(9, "bad"),)
    assert tickets.in_flight == {}
