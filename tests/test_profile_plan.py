"""The memory plan's profiling step (engine/memory_plan.py): its prefill chunk is the last one of a
max_model_len prompt, so the deep-context workspace (HCA's every entry, the indexer over all entries)
is in the measured figure; the probe's few pages hold it."""

from __future__ import annotations

import pytest

from engine.memory_plan import profile_pages, profile_plan, profile_workspace
from models import load_model
from worker import ModelRunner


@pytest.mark.parametrize("max_model_len", [None, 512, 1000])
def test_the_prefill_chunk_ends_at_max_model_len_on_its_own_pages(max_model_len):
    block, seqs, budget = 16, 3, 100
    plan = profile_plan(vocab=50, block=block, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    prefill, *decodes = plan.chunks
    assert len(prefill.token_ids) == budget - (seqs - 1) and all(len(d.token_ids) == 1 and d.position == 0 for d in decodes)
    assert prefill.position + len(prefill.token_ids) == (max_model_len or len(prefill.token_ids))
    assert len(prefill.pages) * block >= prefill.position + len(prefill.token_ids)
    first, last = prefill.position // block, (prefill.position + len(prefill.token_ids) - 1) // block
    own = prefill.pages[first : last + 1]
    assert len(set(own)) == len(own)  # the chunk's tokens land on distinct pages
    used = set(prefill.pages) | {p for d in decodes for p in d.pages}
    assert len(used) == len(set(prefill.pages)) + len(decodes)  # no page shared between sequences
    assert max(used) < profile_pages(seqs, budget, block)


@pytest.mark.parametrize("name", ["mixed", "v41"])
def test_the_deep_profiling_step_runs_on_the_probe_cache(checkpoints, name):
    """V4 (window, CSA and HCA layers) and V4.1: the step runs on a cache of profile_pages pages at a
    position past every compressed group of its chunk's block table."""
    model = load_model(checkpoints[name])
    seqs, budget, max_len = 2, 64, 256
    runner = ModelRunner(model, seqs, max_len, block_tokens=16, num_pages=profile_pages(seqs, budget, 16),
                         max_logit_rows=budget)
    assert profile_workspace(runner, seqs, budget, max_len) >= 0
