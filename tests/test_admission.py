"""Memory admission: pages from the budget, capped by use, pinned by config, refused with advice."""

from __future__ import annotations

import pytest

from contract.config import load_config
from engine.admission import GiB, MemoryPlanError, plan_pages
from engine.factory import build_engine_core


def plan(**overrides):
    args = dict(device="cpu", budget=1 * GiB, weights=100 * 2**20, workspace=50 * 2**20, slot_state=2**20,
                page_bytes=2**16, block_tokens=128, max_num_seqs=8, max_model_len=4096, pinned_pages=None)
    args.update(overrides)
    return plan_pages(**args)


def test_pages_are_what_the_budget_leaves_capped_at_full_use():
    assert plan().num_pages == 8 * 32  # 8 sequences x 4096 / 128 pages: the budget affords more
    tight = plan(budget=160 * 2**20)
    assert tight.num_pages == (160 * 2**20 - 150 * 2**20 - 2**20) // 2**16 == 144
    assert "KV" in tight.describe() and tight.kv_bytes == tight.num_pages * 2**16


def test_pinned_pages_win_and_a_budget_below_one_sequence_is_refused():
    assert plan(pinned_pages=40).num_pages == 40 and plan(pinned_pages=40).pinned
    with pytest.raises(MemoryPlanError, match="lower model.max_model_len"):
        plan(budget=152 * 2**20)


def test_the_engine_sizes_its_cache_from_the_plan(checkpoints):
    config = load_config(overrides=[f"model.path={checkpoints['v41']}", "model.max_model_len=256",
                                    "scheduler.block_tokens=32", "memory.host_memory_gb=0.5"])
    engine, spec = build_engine_core(config, lambda output: None)
    cache = engine.executor.runner.cache
    assert cache.num_pages == spec.memory.num_pages == engine.scheduler.blocks.num_pages
    assert spec.memory.workspace_bytes > 0 and spec.memory.weights_bytes > 0
    pinned = load_config(overrides=[f"model.path={checkpoints['v41']}", "model.max_model_len=256",
                                    "scheduler.block_tokens=32", "memory.num_kv_pages=9"])
    assert build_engine_core(pinned, lambda output: None)[0].executor.runner.cache.num_pages == 9
    too_few = load_config(overrides=[f"model.path={checkpoints['v41']}", "model.max_model_len=256",
                                     "scheduler.block_tokens=32", "memory.num_kv_pages=7"])
    with pytest.raises(MemoryPlanError, match="needs 8 pages"):
        build_engine_core(too_few, lambda output: None)
