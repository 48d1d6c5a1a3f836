"""After warm-up, serving steps allocate no persistent memory: the caller-owned buffers keep their
addresses and the process RSS stays flat over a 500-step decode (CPU; the GPU test checks
torch.cuda.memory_stats)."""

from __future__ import annotations

import os

import torch

from contract import EngineLimits, NewRequest, SamplingParams
from models import load_model
from scheduler import Scheduler
from tests.conftest import random_tokens
from worker import ModelRunner

STEPS = 500
MAX_LEN = 1200


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_decode_allocates_nothing_persistent(checkpoints):
    torch.set_num_threads(1)
    model = load_model(checkpoints["v41"])
    limits = EngineLimits(4, 64, MAX_LEN, model.config.vocab_size, (), block_tokens=16)
    runner = ModelRunner(model, 4, MAX_LEN, num_pages=limits.total_pages, block_tokens=16, max_logit_rows=64)
    scheduler = Scheduler(limits)
    for i in range(4):
        scheduler.add(NewRequest(f"r{i}", random_tokens(20 + i, seed=i), SamplingParams(max_tokens=STEPS + 60, temperature=0.0, ignore_eos=True)))

    def step() -> None:
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))

    for _ in range(60):  # prefill and warm-up
        step()
    buffers = {id(t): t.data_ptr() for t in runner.cache.tensors() + [runner.logits]}
    before = rss_bytes()
    for _ in range(STEPS):
        step()
    growth = rss_bytes() - before
    assert {id(t): t.data_ptr() for t in runner.cache.tensors() + [runner.logits]} == buffers
    assert all(len(r.output_token_ids) > STEPS for r in scheduler.running)
    # the token lists grow by 4 x 500 ints (~70 KB); leaking the step's [4, vocab] logits (8 KiB) each step
    # would be 4 MiB, any activation more
    assert growth < 2 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over {STEPS} decode steps"
