"""The prefix cache's host and disk tiers on the scheduler's side (scheduler/prefix_tiers.py): spills,
write-through, fetches, loads, eviction by value, the disk catalog's round trip, a failed step.

Pure Python: `Worker` executes plans on a model of the bytes. Every GPU, host and disk slot and page
records what it holds (a slot: the tokens its state has seen; a page: for each of its positions, the
tokens up to there), moves copy those records in docs/prefix-tiers.md's order, disk records keep the
seal they were written with and a fetch checks it, and the forward checks that every position a chunk
attends to and the slot it resumes from hold exactly its own history: a move in the wrong place or
order, a reused row, a stale record shows up as a wrong state, as it would on the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from contract import (
    ChunkResult,
    EngineLimits,
    NewRequest,
    PrefixTierLimits,
    SamplingParams,
    StateCopy,
    StepPlan,
    StepResult,
    TierDone,
    TierMove,
    TokenLogprob,
)
from scheduler import Scheduler
from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_tiers import DiskEntry, TierPool

BT = 4  # tokens per page
SEQS = 3  # request slots 0..2; snapshot slots from 3


def make_limits(snapshots: int = 1, host: tuple[int, int] = (4, 16), disk: tuple[int, int] = (0, 0),
                pages: int = 60, budget: int = 32) -> EngineLimits:
    return EngineLimits(SEQS, budget, 64, 1000, (), num_pages=pages, block_tokens=BT, prefix_snapshots=snapshots,
                        prefix_tiers=PrefixTierLimits(*host, *disk))


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 900) for _ in range(n)]


Record = tuple  # what a slot or a page position holds: (salt, the tokens seen up to there)


@dataclass
class Disk:
    """The disk tier's records, kept across a restart: (content, seal) each."""

    slots: dict[int, tuple[Record | None, int]] = field(default_factory=dict)
    pages: dict[int, tuple[list[Record | None], int]] = field(default_factory=dict)


class Worker:
    """Executes plans on the model of the bytes (see the module docstring). Asynchronous moves run
    when they finish: by hand (`finish`), or with `auto` each one finishes after each step with that
    probability, failing with probability `fail` (a failed write leaves torn records)."""

    def __init__(self, scheduler: Scheduler, disk: Disk | None = None, auto: float | None = None,
                 fail: float = 0.0, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.gpu_slots: dict[int, tuple[Record, bool]] = {}  # (state, holds the logits of its last token)
        self.gpu_pages: dict[int, list[Record | None]] = {}
        self.host_slots: dict[int, tuple[Record, bool] | None] = {}
        self.host_pages: dict[int, list[Record | None]] = {}
        self.disk = disk if disk is not None else Disk()
        self.out: dict[int, TierMove] = {}  # asynchronous moves in flight, by ticket
        self.done: list[TierDone] = []
        self.auto, self.fail, self.rng = auto, fail, random.Random(seed)
        self.plans: list[StepPlan] = []
        self.sampled: dict[str, list[int]] = {}

    def step(self) -> StepPlan:
        """One schedule -> execute -> update, then the integrity checks."""
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        result = self.execute(plan)
        self.scheduler.update(plan, result)
        self.scheduler.check_integrity()
        return plan

    def run(self, limit: int = 100) -> None:
        """Steps until the scheduler has no work; with asynchronous moves finished by hand, until only
        they are left (once the last plan sent no moves)."""
        scheduler = self.scheduler
        for _ in range(limit):
            requests = scheduler.waiting or scheduler.running or scheduler._saves
            if not scheduler.has_work or (self.auto is None and not requests and self.plans
                                          and not moves_sent(self.plans[-1])):
                return
            self.step()
        raise AssertionError("the scheduler never ran out of work")

    def finish(self, ticket: int, error: str | None = None) -> None:
        """The asynchronous move `ticket` runs now (or fails); reported with the next step."""
        move = self.out.pop(ticket)
        failed, bad_pages = error is not None, None
        if move.kind == "write":
            failed = failed or not self._write(move, torn=failed)
        elif not failed:
            bad_pages = self._fetch(move)
            failed = bad_pages is not None
        self.done.append(TierDone(ticket, "failed" if failed else None, bad_pages))

    def execute(self, plan: StepPlan) -> StepResult:
        by_kind = {kind: [m for m in plan.tier_moves if m.kind == kind] for kind in ("spill", "write", "fetch", "load")}
        assert list(plan.tier_moves) == [m for kind in ("spill", "write", "fetch", "load") for m in by_kind[kind]]
        for kind in ("spill", "load"):  # the worker copies each kind as one batch: no target twice
            slots = [m.slot[1] for m in by_kind[kind]]
            pages = [target for m in by_kind[kind] for _, target in m.pages]
            assert len(set(slots)) == len(slots) and len(set(pages)) == len(pages), f"a {kind} target twice"
        for move in by_kind["spill"]:
            self.host_slots[move.slot[1]] = self.gpu_slots[move.slot[0]]
            for source, target in move.pages:
                self.host_pages[target] = list(self.gpu_pages[source])
        for move in by_kind["write"] + by_kind["fetch"]:
            assert move.ticket and move.ticket not in self.out and len(move.seals) == 1 + len(move.pages)
            self.out[move.ticket] = move
        for copy in plan.saves:
            self.gpu_slots[copy.target] = self.gpu_slots[copy.source]
        for copy in plan.restores:
            self.gpu_slots[copy.target] = self.gpu_slots[copy.source]
        for move in by_kind["load"]:
            state = self.host_slots[move.slot[0]]
            assert state is not None, "a load from a host slot a failed fetch left unusable"
            self.gpu_slots[move.slot[1]] = state
            for source, target in move.pages:
                self.gpu_pages[target] = list(self.host_pages[source])
        for source, target in plan.page_copies:
            self.gpu_pages[target] = list(self.gpu_pages[source])
        chunks = tuple(self._forward(chunk) for chunk in plan.chunks)
        if self.auto is not None:
            for ticket in [t for t in self.out if self.rng.random() < self.auto]:
                self.finish(ticket, "injected" if self.rng.random() < self.fail else None)
        done, self.done = tuple(self.done), []
        return StepResult(chunks, done)

    def drop_async(self) -> None:
        """A failed step: the moves in flight are abandoned, never reported (the scheduler forgets them)."""
        self.out.clear()
        self.done.clear()

    def _forward(self, chunk) -> ChunkResult:
        request = next(r for r in self.scheduler.running if r.request_id == chunk.request_id)
        history, salt, start = request.all_token_ids, request.cache_salt, chunk.position
        assert tuple(history[start : start + len(chunk.token_ids)]) == chunk.token_ids
        if start:
            state, logits = self.gpu_slots[chunk.slot]
            assert state == (salt, tuple(history[:start])), f"{chunk.request_id} resumes from a wrong state"
            assert logits or chunk.token_ids, f"{chunk.request_id} draws from logits its slot does not hold"
        for j in range(start):
            page = self.gpu_pages[chunk.pages[j // BT]]
            assert page[j % BT] == (salt, tuple(history[: j + 1])), f"{chunk.request_id}: position {j} is wrong"
        for j in range(start, start + len(chunk.token_ids)):
            self.gpu_pages.setdefault(chunk.pages[j // BT], [None] * BT)[j % BT] = (salt, tuple(history[: j + 1]))
        end = start + len(chunk.token_ids)
        self.gpu_slots[chunk.slot] = ((salt, tuple(history[:end])), chunk.sample)
        if not chunk.sample:
            return ChunkResult(chunk.request_id, None)
        token = 7 + sum((i + 1) * t for i, t in enumerate(history[:end])) % 900  # a function of the history
        self.sampled.setdefault(chunk.request_id, []).append(token)
        return ChunkResult(chunk.request_id, TokenLogprob(token, -1.0))

    def _write(self, move: TierMove, torn: bool) -> bool:
        slot = self.host_slots[move.slot[0]]
        self.disk.slots[move.slot[1]] = (None if torn else slot, move.seals[0])
        for (source, target), seal in zip(move.pages, move.seals[1:]):
            self.disk.pages[target] = ([None] * BT if torn else list(self.host_pages[source]), seal)
        return not torn

    def _fetch(self, move: TierMove) -> tuple[int, ...] | None:
        """Verifies every record's seal (a stale or torn one fails the fetch), then fills the host rows;
        a failed fetch leaves them unusable. None when it verified, else the page records that did not
        (as the real worker reports them; () when only the slot record failed)."""
        records = [self.disk.slots.get(move.slot[0])] + [self.disk.pages.get(s) for s, _ in move.pages]
        bad = [r is None or r[0] is None or r[1] != seal for r, seal in zip(records, move.seals)]
        if any(bad):
            self.host_slots[move.slot[1]] = None
            return tuple(source for (source, _), failed in zip(move.pages, bad[1:]) if failed)
        self.host_slots[move.slot[1]] = records[0][0]
        for (source, target), record in zip(move.pages, records[1:]):
            self.host_pages[target] = list(record[0])
        return None


def moves_sent(plan: StepPlan) -> bool:
    return bool(plan.tier_moves or plan.saves)


def moves(plan: StepPlan, kind: str) -> list[TierMove]:
    return [m for m in plan.tier_moves if m.kind == kind]


def running(scheduler: Scheduler, rid: str):
    return next(r for r in scheduler.running if r.request_id == rid)


def serve(worker: Worker, *requests: NewRequest) -> list[StepPlan]:
    """Adds the requests and steps until the scheduler has no work; the plans it ran."""
    first = len(worker.plans)
    for request in requests:
        worker.scheduler.add(request)
    worker.run()
    return worker.plans[first:]


def test_a_gpu_victim_is_spilled_and_a_later_request_loads_it():
    scheduler = Scheduler(make_limits(snapshots=1))
    worker = Worker(scheduler)
    prompt = tokens(10, seed=1)
    serve(worker, NewRequest("a", prompt, params()))
    victim = scheduler.prefix.points[(None, tuple(prompt))]
    gpu_pages = victim.pages
    plans = serve(worker, NewRequest("b", tokens(9, seed=2), params()))  # its point evicts a's
    [spill] = [m for p in plans for m in moves(p, "spill")]
    host = scheduler.tiers.host.points[(None, tuple(prompt))]
    assert spill.slot == (victim.snapshot, host.slot) and spill.ticket == 0 and not spill.seals
    assert spill.pages == tuple(zip(gpu_pages, host.pages)) and len(spill.pages) == 3  # 2 full pages + the partial one
    assert host.has_logits and scheduler.stats().host_points == 1

    scheduler.add(NewRequest("c", prompt + tokens(5, seed=3), params()))
    plan = worker.step()
    [load] = moves(plan, "load")
    chunk = next(c for c in plan.chunks if c.request_id == "c")
    assert load.slot == (host.slot, chunk.slot) and load.pages == tuple(zip(host.pages, chunk.pages[:3]))
    assert chunk.position == 10 and not plan.restores  # the worker checked the state it resumed from
    worker.run()
    stats = scheduler.stats()
    assert stats.host_hit_tokens == 10 and stats.prefix_hit_tokens == 10 and stats.disk_hit_tokens == 0
    assert worker.plans[-1].tickets_out == 0


def test_a_spill_while_the_victims_save_is_pending_copies_the_request_slot():
    scheduler = Scheduler(make_limits(snapshots=1))
    worker = Worker(scheduler)
    first, second = tokens(6, seed=4), tokens(7, seed=5)
    scheduler.add(NewRequest("a", first, params()))
    scheduler.add(NewRequest("b", second, params()))
    worker.step()  # both prompts end in this step: a's point is taken, then b's evicts it before its save ran
    plan = worker.step()  # (a's end point, taken as it finishes, then evicts b's: also before its save ran)
    spill_a, spill_b = moves(plan, "spill")
    slot_a, slot_b = (c.slot for c in worker.plans[0].chunks)
    assert (spill_a.slot[0], spill_b.slot[0]) == (slot_a, slot_b)  # request slots, not snapshot slots never filled
    assert plan.saves == (StateCopy(slot_b, SEQS),)  # the pending saves of the evicted points were dropped
    worker.run()
    plans = serve(worker, NewRequest("c", first + tokens(3, seed=6), params()))
    assert moves(plans[0], "load") and plans[0].chunks[0].position == 6


def test_a_second_victim_in_the_same_plan_does_not_reuse_the_first_ones_host_rows():
    scheduler = Scheduler(make_limits(snapshots=1, host=(1, 8)))
    worker = Worker(scheduler)  # checks that a plan's spills target distinct rows
    prompts = [tokens(6 + i, seed=80 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        scheduler.add(NewRequest(f"r{i}", prompt, params()))
    worker.step()  # all three points are taken after this step: the first two are evicted at once
    assert len(moves(worker.step(), "spill")) == 1
    assert list(scheduler.tiers.host.points) == [(None, tuple(prompts[0]))]  # the second one is lost
    worker.run()
    plans = serve(worker, NewRequest("again", prompts[0] + [3], params()))
    assert moves(plans[0], "load")


def gpu_and_host_points(worker: Worker) -> tuple[list[int], list[int]]:
    """A 10-token point in the host tier and a 6-token one (a full page and a partial one) on the GPU."""
    host, gpu = tokens(10, seed=90), tokens(6, seed=91)
    serve(worker, NewRequest("h", host, params()))
    serve(worker, NewRequest("g", gpu, params()))  # its point evicts h's into the host tier
    return host, gpu


def test_a_load_never_lands_on_a_gpu_hits_page_copy_source():
    scheduler = Scheduler(make_limits(snapshots=1, pages=6))
    worker = Worker(scheduler)
    host, gpu = gpu_and_host_points(worker)
    # "copy" resumes at 6 from the GPU point (its partial page is copied), then "load" needs one page more
    # than is free: evicting the GPU point would free that partial page before the plan's copy reads it
    scheduler.add(NewRequest("copy", gpu + tokens(5, seed=92), params()))
    scheduler.add(NewRequest("load", host + [4], params()))
    plan = worker.step()
    assert plan.page_copies and [c.request_id for c in plan.chunks] == ["copy"]  # "load" waits for pages
    worker.run()
    assert scheduler.stats().host_hit_tokens == 10


def test_a_host_hit_keeps_its_rows_while_its_admission_spills():
    scheduler = Scheduler(make_limits(snapshots=1, host=(1, 8), pages=4))
    worker = Worker(scheduler)
    host, _ = gpu_and_host_points(worker)
    plans = serve(worker, NewRequest("load", host + [4], params()))  # its pages evict the GPU point
    assert moves(plans[0], "load") and not moves(plans[0], "spill")  # the only host slot is the load's
    assert scheduler.stats().host_hit_tokens == 10


def test_write_through_pins_the_host_point_until_its_write_is_done():
    scheduler = Scheduler(make_limits(snapshots=1, host=(1, 8), disk=(4, 16)))
    worker = Worker(scheduler)
    prompts = [tokens(10, seed=10 + i) for i in range(4)]
    serve(worker, NewRequest("a", prompts[0], params()))
    scheduler.add(NewRequest("b", prompts[1], params()))
    worker.step()
    plan = worker.step()  # b's point evicted a's: spill a, and write it through
    assert len(moves(plan, "spill")) == 1
    [write] = moves(plan, "write")
    host = scheduler.tiers.host.points[(None, tuple(prompts[0]))]
    disk = scheduler.tiers.disk.points[(None, tuple(prompts[0]))]
    assert write.slot == (host.slot, disk.slot) and write.pages == tuple(zip(host.pages, disk.pages))
    assert write.seals == scheduler.tiers.disk.seals(disk) and all(0 <= s < 1 << 63 for s in write.seals)
    assert host.pins == 1 and plan.tickets_out == 1 and scheduler.has_work
    assert scheduler.disk_entries() == []  # not committed before its TierDone
    version = scheduler.disk_version
    for _ in range(3):
        worker.step()  # the write stays out: the scheduler keeps stepping
    assert scheduler.has_work and worker.plans[-1].tickets_out == 1

    plans = serve(worker, NewRequest("c", prompts[2], params()))  # evicts b's point
    assert not [m for p in plans for m in moves(p, "spill")]  # the only host slot is pinned: b's point is lost
    assert list(scheduler.tiers.host.points) == [(None, tuple(prompts[0]))]

    worker.finish(write.ticket)
    worker.step()
    assert host.pins == 0 and scheduler.disk_version > version
    [entry] = scheduler.disk_entries()
    assert entry.tokens == tuple(prompts[0]) and entry.slot == disk.slot and entry.seals == write.seals
    plans = serve(worker, NewRequest("d", prompts[3], params()))  # evicts c's point: a's host point makes room
    assert [m.slot[1] for p in plans for m in moves(p, "spill")] == [host.slot]
    assert (None, tuple(prompts[2])) in scheduler.tiers.host.points and scheduler.stats().disk_points == 2


def disk_of(prompts: list[list[int]], limits: EngineLimits) -> tuple[list[DiskEntry], Disk]:
    """A server that served these prompts one by one, each point evicted to host and written to disk:
    its catalog and its disk records (as they would survive a restart)."""
    scheduler = Scheduler(limits)
    worker = Worker(scheduler, auto=1.0)
    for i, prompt in enumerate(prompts + [tokens(9, seed=99)]):
        serve(worker, NewRequest(f"w{i}", prompt, params()))
    return scheduler.disk_entries(), worker.disk


def restarted(limits: EngineLimits, entries: list[DiskEntry], disk: Disk) -> tuple[Scheduler, Worker]:
    scheduler = Scheduler(limits)
    scheduler.seed_disk(entries)
    return scheduler, Worker(scheduler, disk=disk)


def test_a_disk_hit_is_fetched_while_the_requests_behind_it_run():
    limits = make_limits(snapshots=1, disk=(4, 16))
    prompt = tokens(10, seed=20)
    entries, disk = disk_of([prompt], limits)
    scheduler, worker = restarted(limits, entries, disk)
    [entry] = [e for e in entries if e.tokens == tuple(prompt)]
    scheduler.add(NewRequest("other", tokens(6, seed=21), params(3)))
    worker.step()
    scheduler.add(NewRequest("hit", prompt + tokens(3, seed=22), params()))
    scheduler.add(NewRequest("behind", tokens(5, seed=23), params()))
    plan = worker.step()
    [fetch] = moves(plan, "fetch")
    host = next(iter(scheduler.tiers.host.points.values()))
    assert fetch.slot == (entry.slot, host.slot) and fetch.pages == tuple(zip(entry.pages, host.pages))
    assert fetch.seals == entry.seals and fetch.ticket and plan.tickets_out == 1
    assert [c.request_id for c in plan.chunks] == ["other", "behind"]  # admitted past the waiting one
    worker.step()
    assert [r.request_id for r in scheduler.waiting] == ["hit"] and scheduler.has_work
    worker.finish(fetch.ticket)
    worker.step()  # the TierDone arrives
    plan = worker.step()
    [load] = moves(plan, "load")
    assert load.slot[0] == host.slot and next(c for c in plan.chunks if c.request_id == "hit").position == 10
    worker.run()
    stats = scheduler.stats()
    assert stats.disk_hit_tokens == 10 and stats.host_hit_tokens == 0 and stats.prefix_hit_tokens == 10
    plans = serve(worker, NewRequest("again", prompt + [8], params()))  # in host and on disk: host wins
    assert moves(plans[0], "load") and not moves(plans[0], "fetch") and scheduler.stats().host_hit_tokens == 10


def test_a_failed_fetch_drops_the_disk_point_and_the_request_takes_a_shorter_hit():
    limits = make_limits(snapshots=1, disk=(4, 16))
    prompt = tokens(14, seed=30)
    entries, disk = disk_of([prompt[:6], prompt], limits)
    long = next(e for e in entries if e.tokens == tuple(prompt))
    disk.slots[long.slot] = (disk.slots[long.slot][0], 12345)  # a stale record: an older write's seal
    scheduler, worker = restarted(limits, entries, disk)
    version = scheduler.disk_version
    scheduler.add(NewRequest("hit", prompt + tokens(2, seed=31), params()))
    plan = worker.step()
    [fetch] = moves(plan, "fetch")
    worker.finish(fetch.ticket)  # the seal does not verify
    worker.step()  # its TierDone arrives
    assert scheduler.stats().fetch_failures == 1 and scheduler.disk_version > version
    assert [e.tokens for e in scheduler.disk_entries()] == [tuple(prompt[:6])]
    [fetch] = moves(worker.step(), "fetch")  # looked up again: the shorter point
    worker.finish(fetch.ticket)
    worker.run()
    assert scheduler.stats().disk_hit_tokens == 6


def test_a_failed_fetch_with_no_other_hit_recomputes_and_an_aborted_waiter_keeps_the_fetch():
    limits = make_limits(snapshots=1, disk=(4, 16))
    prompt, other = tokens(10, seed=40), tokens(11, seed=41)
    entries, disk = disk_of([prompt, other], limits)
    scheduler, worker = restarted(limits, entries, disk)
    scheduler.add(NewRequest("fails", prompt + [5], params()))
    scheduler.add(NewRequest("aborted", other + [5], params()))
    [first, second] = moves(worker.step(), "fetch")
    assert scheduler.abort("aborted").finish_reason == "abort"
    worker.finish(first.ticket, "EIO")
    worker.finish(second.ticket)
    worker.run()
    [chunk] = [c for p in worker.plans for c in p.chunks if c.request_id == "fails"]
    assert chunk.position == 0  # recomputed from scratch
    assert (None, tuple(other)) in scheduler.tiers.host.points  # the aborted request's fetch still landed
    assert scheduler.stats().fetch_failures == 1


def test_eviction_by_value_keeps_a_long_often_hit_point_and_ages_it_out_unused():
    blocks = BlockManager(num_pages=64, block_tokens=BT, num_slots=1)
    cache = PrefixCache([1, 2], block_tokens=BT, blocks=blocks)
    blocks.evict = cache.evict_one
    blocks.open("r")
    blocks.grow("r", 200)
    table = tuple(blocks.table("r"))
    long = cache.insert(None, tuple(range(40)), table)
    for _ in range(2):
        cache.touch(long)  # priority 0 + 3 * 40
    cache.insert(None, tuple(range(100, 108)), table)  # newer, short, never hit
    cache.insert(None, tuple(range(200, 208)), table)  # evicts the short one (LRU would evict the long one)
    assert (None, tuple(range(40))) in cache.points and (None, tuple(range(100, 108))) not in cache.points
    for i in range(3, 30):  # every victim raises the clock: unused, the long point ages out
        cache.insert(None, tuple(range(100 * i, 100 * i + 8)), table)
        if (None, tuple(range(40))) not in cache.points:
            break
    assert (None, tuple(range(40))) not in cache.points and 10 < i < 20

    pool = TierPool("host", 2, 40, BT)
    reserved = [pool.reserve(None, tuple(range(k, k + n)), False, hits)[0] for k, n, hits in
                ((0, 40, 2), (1000, 8, 0))]
    for point in reserved:
        pool.publish(point)
    reserved[0].pins = 1  # a move reads it: never a victim
    third, _ = pool.reserve(None, tuple(range(2000, 2008)), False, 0)
    assert reserved[1].key not in pool.points and reserved[0].key in pool.points
    pool.publish(third)
    assert pool.reserve(None, tuple(range(3000, 3040)), False, 0) is not None  # evicts `third`, not the pinned one
    assert reserved[0].key in pool.points and third.key not in pool.points


def test_host_tier_stores_a_conversations_full_pages_once():
    scheduler = Scheduler(make_limits(snapshots=2, host=(4, 16)))
    worker = Worker(scheduler)
    prompt = tokens(10, seed=50)
    serve(worker, NewRequest("turn1", prompt, params()))
    answer = worker.sampled["turn1"]
    follow_up = prompt + answer + tokens(6, seed=51)  # 17 tokens: a GPU hit at 10, a point at 17
    serve(worker, NewRequest("turn2", follow_up, params()))
    plans = serve(worker, NewRequest("x", tokens(9, seed=52), params()), NewRequest("y", tokens(9, seed=53), params()))
    spills = [m for p in plans for m in moves(p, "spill")]
    host = scheduler.tiers.host
    short, long = host.points[(None, tuple(prompt))], host.points[(None, tuple(follow_up))]
    assert short.pages[:2] == long.pages[:2] and short.pages[2] != long.pages[2]  # the partial page is its own
    assert [len(m.pages) for m in spills] == [5, 1]  # the second spill copies only its partial page
    assert host.page_refs[short.pages[0]] == 2 and host.num_pages - len(host.free_pages) == 6  # not 3 + 5
    plans = serve(worker, NewRequest("turn3", follow_up + [3], params()))
    assert [m.slot[0] for m in moves(plans[0], "load")] == [long.slot]


def test_disk_entries_seed_a_restarted_scheduler_and_bad_entries_are_refused():
    limits = make_limits(snapshots=1, disk=(6, 24))
    prompt = tokens(13, seed=60)
    entries, _ = disk_of([prompt[:9], prompt, tokens(7, seed=61)], limits)
    assert len(entries) == 3 and all(len(e.seals) == len(e.pages) + 1 for e in entries)
    scheduler = Scheduler(limits)
    scheduler.seed_disk(entries)
    assert sorted(scheduler.disk_entries(), key=lambda e: e.slot) == sorted(entries, key=lambda e: e.slot)
    assert scheduler.disk_version > 0 and scheduler.stats().disk_points == 3
    scheduler.check_integrity()
    shared = {e.tokens: e for e in entries}
    short, long = shared[tuple(prompt[:9])], shared[tuple(prompt)]
    assert short.pages[:2] == long.pages[:2] and scheduler.tiers.disk.page_refs[long.pages[0]] == 2

    bad = [
        [replace(long, seals=long.seals[:-1])],  # a seal missing
        [short, replace(long, slot=short.slot)],  # one slot twice
        [short, replace(long, seals=(long.seals[0], long.seals[1] ^ 1) + long.seals[2:])],  # a shared page's two seals
        [short, replace(long, tokens=(1,) + long.tokens[1:])],  # a page shared by different tokens
        [replace(short, pages=(short.pages[0], short.pages[0], short.pages[2]))],
        [replace(long, pages=(99,) + long.pages[1:])],  # outside the tier
    ]
    for entries_ in bad:
        fresh = Scheduler(limits)
        with pytest.raises(ValueError):
            fresh.seed_disk(entries_)
        assert fresh.disk_entries() == []
        fresh.check_integrity()
    with pytest.raises(ValueError, match="off"):
        Scheduler(make_limits(snapshots=1)).seed_disk(entries)


def test_a_failed_step_drops_the_host_tier_and_forgets_moves_in_flight():
    limits = make_limits(snapshots=1, disk=(4, 16))
    prompts = [tokens(10, seed=70 + i) for i in range(3)]
    scheduler = Scheduler(limits)
    worker = Worker(scheduler)
    serve(worker, NewRequest("a", prompts[0], params()))
    plans = serve(worker, NewRequest("b", prompts[1], params()))
    [write] = [m for p in plans for m in moves(p, "write")]
    worker.finish(write.ticket)
    plans = serve(worker, NewRequest("c", prompts[2], params()))  # b spilled, its write out
    [late] = [m for p in plans for m in moves(p, "write")]
    assert scheduler.stats().host_points == 2 and len(scheduler.disk_entries()) == 1
    scheduler.add(NewRequest("d", prompts[1] + [4], params()))
    scheduler.schedule()
    scheduler.fail_all("the step failed")
    worker.drop_async()
    stats = scheduler.stats()
    assert stats.host_points == 0 and stats.prefix_points == 0 and not scheduler.tiers.tickets
    assert [e.tokens for e in scheduler.disk_entries()] == [tuple(prompts[0])]  # the committed point stays
    scheduler.check_integrity()
    result = StepResult((), (TierDone(late.ticket),))  # a forgotten move reported late: ignored
    scheduler.update(StepPlan(()), result)
    scheduler.check_integrity()
    worker.auto = 1.0
    serve(worker, NewRequest("e", prompts[0] + [4], params()))  # from disk, verified, state exact
    assert scheduler.stats().disk_hit_tokens == 10


def test_random_workload_keeps_every_tier_consistent_and_every_state_exact():
    rng = random.Random(7)
    limits = make_limits(snapshots=3, host=(5, 14), disk=(8, 24), pages=40, budget=12)
    scheduler = Scheduler(limits)
    worker = Worker(scheduler, auto=0.4, fail=0.15, seed=8)
    conversations: list[tuple[str | None, list[int]]] = []
    live: list[str] = []
    for step in range(700):
        if rng.random() < 0.35 and len(scheduler.waiting) < 6:
            rid = f"r{step}"
            if conversations and rng.random() < 0.7:
                salt, history = rng.choice(conversations)
                cut = len(history) if rng.random() < 0.6 else rng.randrange(1, len(history) + 1)
                prompt = history[:cut] + tokens(rng.randrange(0, 6), seed=step)
            else:
                salt, prompt = rng.choice([None, "tenant"]), tokens(rng.randrange(3, 20), seed=step)
            prompt = prompt[:40] or [5]
            scheduler.add(NewRequest(rid, prompt, params(rng.randrange(1, 5)), cache_salt=salt))
            conversations.append((salt, prompt))
            live.append(rid)
        if live and rng.random() < 0.03:
            scheduler.abort(live.pop(rng.randrange(len(live))))
        for request in scheduler.running:
            conversations.append((request.cache_salt, request.all_token_ids))
        conversations[:] = conversations[-40:]
        if rng.random() < 0.01:  # a step whose forward fails: its moves were issued and still report
            plan = scheduler.schedule()
            result = worker.execute(plan)
            scheduler.fail_all("injected")
            scheduler.update(StepPlan(()), StepResult((), result.tier_done))
            scheduler.check_integrity()
        elif scheduler.has_work:
            worker.step()
    worker.fail = 0.0
    worker.run(limit=400)
    stats = scheduler.stats()
    assert stats.host_hit_tokens and stats.disk_hit_tokens and stats.fetch_failures
    assert not scheduler.tiers.tickets and scheduler.blocks.stats().held == 0


def test_a_fetch_out_when_a_step_fails_keeps_its_host_rows_until_it_reports():
    """The worker's reader may still fill a fetch's host rows after a failed step, so fail_all orphans
    the fetch instead of forgetting it: its rows are not handed out again until its TierDone, which
    then drops them whatever it says."""
    limits = make_limits(snapshots=1, host=(2, 16), disk=(4, 16))
    prompt = tokens(10, seed=90)
    entries, disk = disk_of([prompt], limits)
    scheduler, worker = restarted(limits, entries, disk)
    scheduler.add(NewRequest("hit", prompt + [5], params()))
    [fetch] = moves(worker.step(), "fetch")
    host = scheduler.tiers.host
    target = next(iter(host.points.values()))
    scheduler.fail_all("the step failed")
    assert target.slot not in host.free_slots and not set(target.pages) & set(host.free_pages)
    assert scheduler.has_work and scheduler.tiers.tickets[fetch.ticket].orphaned
    scheduler.check_integrity()
    worker.finish(fetch.ticket)
    worker.step()  # the TierDone arrives ("hit" meanwhile recomputes: its point's rows were the orphan's)
    assert target.slot in host.free_slots and not host.points  # free again, nothing was published
    scheduler.check_integrity()
    worker.auto = 1.0
    serve(worker, NewRequest("again", prompt + [6], params()))  # the disk point is fetched anew and served
    assert scheduler.stats().disk_hit_tokens == 10


def test_a_failed_page_record_takes_every_disk_point_holding_it():
    """A bad page record is shared by the points of one conversation: they all go (a recomputed prefix
    written through must write that page anew), while a bad slot record is its point's own (the test
    above: the shorter point survives)."""
    limits = make_limits(snapshots=1, disk=(4, 16))
    prompt = tokens(14, seed=32)
    entries, disk = disk_of([prompt[:6], prompt], limits)
    long = next(e for e in entries if e.tokens == tuple(prompt))
    short = next(e for e in entries if e.tokens == tuple(prompt[:6]))
    shared = long.pages[0]
    assert shared == short.pages[0]
    disk.pages[shared] = (disk.pages[shared][0], 54321)  # a stale record of the first page
    scheduler, worker = restarted(limits, entries, disk)
    scheduler.add(NewRequest("hit", prompt + tokens(2, seed=33), params()))
    [fetch] = moves(worker.step(), "fetch")
    worker.finish(fetch.ticket)
    worker.step()
    assert scheduler.stats().fetch_failures == 1
    assert not [e for e in scheduler.disk_entries() if shared in e.pages]  # both points went
    worker.auto = 1.0
    worker.run()
    assert scheduler.stats().disk_hit_tokens == 0  # recomputed
