"""Pages and slots: reference counts, release, preemption under page pressure, integrity."""

from __future__ import annotations

import pytest

from contract import ChunkResult, EngineLimits, NewRequest, SamplingParams, StepResult, TokenLogprob
from scheduler import Scheduler
from scheduler.block_manager import BlockManager


def test_grow_and_close_keep_the_books_balanced():
    blocks = BlockManager(num_pages=6, block_tokens=4, num_slots=2)
    blocks.open("a")
    assert blocks.grow("a", 9) and blocks.table("a") == [0, 1, 2]
    blocks.open("b")
    assert not blocks.grow("b", 16)  # needs 4, 3 left: nothing taken
    assert blocks.table("b") == [] and blocks.stats().free == 3
    assert blocks.grow("b", 12)
    blocks.check_integrity()
    assert blocks.stats().held == 6 and blocks.stats().usage == 1.0
    blocks.close("a")
    blocks.check_integrity()
    assert blocks.stats().free == 3 and blocks.stats().slots_free == 1


def test_integrity_check_catches_a_leak():
    blocks = BlockManager(num_pages=4, block_tokens=4, num_slots=1)
    blocks.open("a")
    blocks.grow("a", 8)
    blocks.tables["a"].pop()  # a page taken but no longer in any table
    with pytest.raises(AssertionError, match="reference counts"):
        blocks.check_integrity()


def step_all(scheduler: Scheduler, token: int = 5) -> list[str]:
    """Runs one scheduled step with a fake model that samples `token` everywhere."""
    plan = scheduler.schedule()
    results = tuple(
        ChunkResult(c.request_id, TokenLogprob(token, -1.0) if c.sample else None) for c in plan.chunks
    )
    scheduler.update(plan, StepResult(results))
    scheduler.check_integrity()
    return [c.request_id for c in plan.chunks]


def test_page_pressure_preempts_the_newest_and_recomputes_it():
    # 2 slots, 5 pages of 4 tokens: two 8-token prompts fit (4 pages); growing both needs 6.
    limits = EngineLimits(2, 64, 20, 100, (), num_pages=5, block_tokens=4)
    scheduler = Scheduler(limits)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler.add(NewRequest("old", list(range(10, 18)), params))
    scheduler.add(NewRequest("new", list(range(20, 28)), params))
    assert step_all(scheduler) == ["old", "new"]
    ran = [step_all(scheduler) for _ in range(3)]
    assert scheduler.num_preemptions >= 1
    assert any("new" not in step for step in ran)  # the newest one was pushed out, the oldest kept going
    old = next(r for r in scheduler.running if r.request_id == "old")
    assert len(old.output_token_ids) == 4
    while scheduler.has_work:
        step_all(scheduler)
    assert scheduler.blocks.stats().held == 0 and scheduler.blocks.stats().slots_free == 2


def test_requests_larger_than_the_whole_cache_are_refused_up_front():
    limits = EngineLimits(2, 64, 1000, 100, (), num_pages=3, block_tokens=4)
    with pytest.raises(ValueError, match="needs 20 tokens of KV cache; this server's cache holds 12"):
        Scheduler(limits).validate(NewRequest("x", list(range(10)), SamplingParams(max_tokens=10)))


def test_abort_mid_prefill_and_mid_decode_frees_everything():
    limits = EngineLimits(2, 8, 100, 100, (), num_pages=20, block_tokens=4)
    scheduler = Scheduler(limits)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    scheduler.add(NewRequest("long", list(range(40)), params))  # prefills over 5 steps of 8 tokens
    scheduler.add(NewRequest("short", [3, 4], params))
    step_all(scheduler)
    assert scheduler.abort("long").finish_reason == "abort"  # mid-prefill
    scheduler.check_integrity()
    for _ in range(3):
        step_all(scheduler)
    assert scheduler.abort("short").finish_reason == "abort"  # mid-decode
    scheduler.check_integrity()
    stats = scheduler.stats()
    assert stats.blocks.held == 0 and stats.blocks.slots_free == 2 and stats.running == stats.waiting == 0
