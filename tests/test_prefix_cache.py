"""The prefix cache: state points (slot snapshots + shared pages) resumed exactly, pages shared and
evicted safely, tenants kept apart. Engine tests run the real tiny models on the CPU."""

from __future__ import annotations

import pytest

from contract import EngineLimits, NewRequest, SamplingParams
from engine.loop import EngineCore
from models import load_model
from scheduler import Scheduler
from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import PrefixCache
from tests.conftest import random_tokens
from worker import ModelRunner

MAX_LEN = 256
BLOCK = 16


class Outputs:
    def __init__(self) -> None:
        self.by_request: dict[str, list] = {}

    def __call__(self, outputs) -> None:  # one engine step's outputs
        for output in outputs:
            self.by_request.setdefault(output.request_id, []).append(output)

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.by_request.get(rid, ()))

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.by_request[rid] for t in o.new_token_ids]

    def logprobs(self, rid: str) -> list:
        return [lp for o in self.by_request[rid] for lp in o.new_logprobs]

    def cached(self, rid: str) -> int:
        return self.by_request[rid][-1].num_cached_tokens


def make_engine(model, *, snapshots: int = 16, deterministic: bool = True, num_pages: int | None = None,
                max_num_seqs: int = 4, budget: int = 64, device: str = "cpu",
                kv_cache_dtype: str = "auto", kv_hot_tokens: int | None = None) -> tuple[EngineCore, Outputs]:
    config = model.config
    limits = EngineLimits(max_num_seqs, budget, MAX_LEN, config.vocab_size, config.eos_token_ids,
                             num_pages=num_pages, block_tokens=BLOCK, prefix_snapshots=snapshots)
    runner = ModelRunner(model, max_num_seqs, MAX_LEN, device=device, num_pages=limits.total_pages, block_tokens=BLOCK,
                         deterministic=deterministic, snapshot_slots=snapshots, kv_cache_dtype=kv_cache_dtype,
                         kv_hot_tokens=kv_hot_tokens)
    outputs = Outputs()
    return EngineCore(Scheduler(limits), runner, outputs), outputs


def run(engine: EngineCore, outputs: Outputs, requests: list[NewRequest], watch=None) -> None:
    """Steps the engine on this thread until every request finished; `watch(engine)` after each step."""
    for request in requests:
        engine.scheduler.add(request)
    while not all(outputs.finished(r.request_id) for r in requests):
        engine.step()
        if watch is not None:
            watch(engine)
    while engine.scheduler.has_work:  # the last points' snapshots
        engine.step()
    engine.scheduler.check_integrity()


def clobber(engine: EngineCore, outputs: Outputs) -> None:
    """Runs an unrelated request, so the slots no longer hold the state a hit must restore."""
    run(engine, outputs, [NewRequest(f"other-{len(outputs.by_request)}", random_tokens(30, seed=99),
                                  SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))])


def full_logprobs(model, n: int = 6) -> SamplingParams:
    """Greedy, with the whole log-softmax reported: equal entries mean equal logits."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=model.config.vocab_size)


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request, checkpoints):
    return load_model(checkpoints[request.param if request.param == "v41" else "mixed"])


# Hit positions: 7 (the sliding window of 16 not yet full), 37 (inside a ratio-2 / rate-4 / rate-16
# compression group, the window wrapped, an Engram 3-gram spanning it, a partial page), 48 (page-aligned),
# 90 (the same prompt again: the point kept the logits, the first token needs no forward).
@pytest.mark.parametrize("hit", [7, 37, 48, 90])
def test_deterministic_hit_is_bitwise_the_cold_run(model, hit):
    prompt = random_tokens(90, seed=hit)
    cold_engine, cold = make_engine(model)
    run(cold_engine, cold, [NewRequest("cold", prompt, full_logprobs(model))])
    assert cold.cached("cold") == 0
    engine, warm = make_engine(model)
    run(engine, warm, [NewRequest("first", prompt[:hit], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
    clobber(engine, warm)
    run(engine, warm, [NewRequest("warm", prompt, full_logprobs(model))])
    assert warm.cached("warm") == hit
    assert warm.tokens("warm") == cold.tokens("cold")
    assert warm.logprobs("warm") == cold.logprobs("cold")  # every logprob of the vocabulary, bitwise


def test_default_mode_hit_agrees_with_the_cold_run(model):
    prompt = random_tokens(100, seed=5)
    cold_engine, cold = make_engine(model, deterministic=False)
    run(cold_engine, cold, [NewRequest("cold", prompt, full_logprobs(model, 8))])
    engine, warm = make_engine(model, deterministic=False)
    run(engine, warm, [NewRequest("first", prompt[:53], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])
    clobber(engine, warm)
    run(engine, warm, [NewRequest("warm", prompt, full_logprobs(model, 8))])
    assert warm.cached("warm") == 53
    assert warm.tokens("warm") == cold.tokens("cold")
    for a, b in zip(warm.logprobs("warm"), cold.logprobs("cold"), strict=True):
        assert max(abs(x - y) for (_, x), (_, y) in zip(sorted(a.top), sorted(b.top), strict=True)) < 1e-4


def test_follow_up_resumes_where_the_first_request_finished(model):
    """A chat's next turn: the first answer's tokens (all but the last, never computed) are reused."""
    prompt = random_tokens(40, seed=9)
    engine, outputs = make_engine(model)
    run(engine, outputs, [NewRequest("turn1", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))])
    follow_up = prompt + outputs.tokens("turn1") + random_tokens(12, seed=10)
    clobber(engine, outputs)
    run(engine, outputs, [NewRequest("turn2", follow_up, full_logprobs(model))])
    assert outputs.cached("turn2") == len(prompt) + 10 - 1
    cold_engine, cold = make_engine(model)
    run(cold_engine, cold, [NewRequest("turn2", follow_up, full_logprobs(model))])
    assert outputs.logprobs("turn2") == cold.logprobs("turn2")


def test_concurrent_requests_share_the_prefix_pages(model):
    shared = random_tokens(64, seed=11)
    engine, outputs = make_engine(model)
    run(engine, outputs, [NewRequest("warm-up", shared + [9], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
    clobber(engine, outputs)
    followers = [NewRequest(f"f{i}", shared + random_tokens(20, seed=20 + i), full_logprobs(model, 4)) for i in range(2)]
    held: list[int] = []
    run(engine, outputs, followers, watch=lambda e: held.append(e.scheduler.stats().blocks.held))
    assert [outputs.cached(r.request_id) for r in followers] == [64, 64]
    # alone, each needs ceil((84 + 4) / 16) = 6 pages; sharing the 4 full prefix pages, both hold 8, not 12
    assert max(held) == 8
    for request in followers:
        cold_engine, cold = make_engine(model)
        run(cold_engine, cold, [NewRequest(request.request_id, request.prompt_token_ids, full_logprobs(model, 4))])
        assert outputs.logprobs(request.request_id) == cold.logprobs(request.request_id)


def test_cache_salt_keeps_tenants_apart(model):
    prompt = random_tokens(50, seed=12)
    engine, outputs = make_engine(model)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(engine, outputs, [NewRequest("a1", prompt, greedy, cache_salt="tenant-a")])
    run(engine, outputs, [NewRequest("b1", prompt, greedy, cache_salt="tenant-b"), NewRequest("n1", prompt, greedy)])
    assert outputs.cached("b1") == outputs.cached("n1") == 0
    run(engine, outputs, [NewRequest("a2", prompt, greedy, cache_salt="tenant-a")])
    assert outputs.cached("a2") == len(prompt)


def test_pressure_evicts_cached_points_but_never_held_pages(model):
    """A pool of 12 pages: points pile up, then new requests need their pages back."""
    engine, outputs = make_engine(model, num_pages=12, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def watch(e: EngineCore) -> None:
        e.scheduler.check_integrity()  # held pages are exactly the running tables', never handed out twice

    for i in range(6):
        run(engine, outputs, [NewRequest(f"r{i}a", random_tokens(70, seed=30 + i), greedy),
                              NewRequest(f"r{i}b", random_tokens(60, seed=40 + i), greedy)], watch=watch)
    stats = engine.scheduler.stats()
    assert stats.blocks.held == 0 and stats.blocks.cached > 0 and stats.prefix_points > 0


# Pure bookkeeping (no model)


def test_lookup_takes_the_longest_exact_point_and_leaves_a_token_to_compute():
    blocks = BlockManager(num_pages=16, block_tokens=4, num_slots=2)
    cache = PrefixCache([2, 3, 4], block_tokens=4, blocks=blocks)
    blocks.evict = cache.evict_one
    tokens = list(range(100, 120))
    blocks.open("r")
    blocks.grow("r", 20)
    table = tuple(blocks.table("r"))
    short, long = cache.insert(None, tuple(tokens[:6]), table), cache.insert(None, tuple(tokens[:13]), table)
    assert cache.insert(None, tuple(tokens[:13]), table) is None  # the same point again: refreshed only
    assert cache.lookup(None, tokens).point is long
    assert cache.lookup(None, tokens[:13]).point is short  # without logits a hit leaves one token to compute
    with_logits = cache.insert(None, tuple(tokens[:13]), table, has_logits=True)  # replaces the point
    assert cache.lookup(None, tokens[:13]).point is with_logits and cache.num_points == 2
    assert cache.lookup(None, tokens[:10] + [1, 2, 3, 4]).point is short  # diverges before 13
    assert cache.lookup("salted", tokens) is None
    assert with_logits.pages == table[:4] and short.pages == table[:2]
    blocks.close("r")
    assert blocks.stats().cached == 4 and blocks.stats().held == 0 and blocks.available_pages == 16
    assert blocks.grow(blocks_open(blocks, "s"), 64)  # needs all 16 pages: every point is evicted
    assert cache.num_points == 0 and blocks.stats().held == 16


def blocks_open(blocks: BlockManager, rid: str) -> str:
    blocks.open(rid)
    return rid
