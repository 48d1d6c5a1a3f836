"""The KV host tier (`offload.kv: host_packed`): V4.1's packed compressed entries in shared host memory,
a GPU ring of each sequence's recent pages. Reads are bitwise those of packed pages on the device,
whichever pages are hot, so logits equal the plain cache past the ring too."""

from __future__ import annotations

import pytest
import torch

from kernels.host_memory import mapped_host_bytes
from models import DecodeBatch, ForwardBatch, ModelCache, load_model
from models.host_tier import HostTierSpec, HotRing, TieredPages
from models.packed_pages import PackedPages
from tests.conftest import random_tokens

BLOCK = 16


def test_mapped_host_bytes_are_a_zeroed_shared_mapping():
    memory = mapped_host_bytes(1000, "cpu")
    assert memory.host.shape == (1000,) and memory.host.dtype == torch.uint8 and not memory.host.any()
    assert memory.device is memory.host  # off CUDA the host bytes are the compute device's
    memory.host[7] = 9
    assert int(memory.host[7]) == 9


def test_tiered_pages_read_what_packed_pages_read_whatever_is_hot():
    check_tiered_pages("cpu")


def check_tiered_pages(device: str) -> None:
    """Same writes into a device PackedPages and a tiered store under a changing hot set: every read of
    every entry is bitwise the same, and a cold page's bytes come from the host tier only."""
    generator = torch.Generator(device).manual_seed(0)
    plain = PackedPages.allocate(8, 4, 32, "e4m3", torch.float32, device)
    hot = HotRing(num_pages=8, ring_pages=2, hot_pages=2, block_tokens=4, device=device)
    tiered = TieredPages.allocate(hot, 8, 4, 32, "e4m3", torch.float32, device)
    every_page = torch.arange(8, device=device)[:, None].expand(8, 4)
    every_index = torch.arange(4, device=device)[None, :].expand(8, 4)
    for step, wanted in enumerate([[0, 1], [1, 2], [5, 3], [6], [0, 7], [7, 6]]):
        hot.hold(wanted)
        assert sorted(hot.held) == sorted(set(wanted) | (set(hot.held) - set(wanted)))
        assert all(int(hot.location[p]) >= 0 for p in wanted) and len(hot.held) <= 2
        written = wanted[0] * 4 + step % 4  # one write into a hot page every step
        others = [e for e in torch.randperm(32, generator=generator, device=device).tolist() if e != written]
        entries = torch.tensor([written] + others[:5], device=device)  # distinct: no write races another
        page, index = entries // 4, entries % 4
        values = torch.randn(6, 32, generator=generator, device=device)
        where = torch.rand(6, generator=generator, device=device) > 0.3
        for store in (plain, tiered):
            store.put(page, index, values, where if step % 2 else None)
        assert torch.equal(tiered.at(every_page, every_index), plain.at(every_page, every_index))
        tables = torch.tensor([[wanted[0], 4]], device=device)
        assert torch.equal(tiered.pages(tables), plain.pages(tables))
    cold = next(p for p in range(8) if p not in hot.held)
    tiered.host.codes[cold] ^= 0xFF  # the only copy of a cold page: its reads change
    assert not torch.equal(tiered.at(every_page[cold], every_index[cold]), plain.at(every_page[cold], every_index[cold]))
    with pytest.raises(ValueError, match="ring holds 2"):
        hot.hold([1, 2, 3])


def run_tiered(model, hot_tokens: int, deterministic: bool) -> list[torch.Tensor]:
    """Three prompts of up to 120 tokens (every position's logits), then 10 decode steps through the
    chunked forward and the decode path, on a plain cache and on packed pages with a host tier whose
    ring holds `hot_tokens` tokens of each sequence: bitwise the same logits at every position."""
    from contextlib import nullcontext

    from kernels.batch_invariant import BatchInvariantMode

    mode = BatchInvariantMode if deterministic else nullcontext
    slot_pages = 9
    pages = {slot: [3 * slot_pages - 1 - slot_pages * slot - i for i in range(slot_pages)] for slot in range(3)}
    caches = [
        ModelCache.allocate(model.config, 3, 144, num_pages=3 * slot_pages, block_tokens=BLOCK),
        ModelCache.allocate(model.config, 3, 144, num_pages=3 * slot_pages, block_tokens=BLOCK, kv_cache_dtype="fp4",
                            host_tier=HostTierSpec(hot_tokens, 3)),
    ]
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate([70, 120, 95])]
    outputs = []
    for cache in caches:
        logits = []
        with mode():
            for start in range(0, 120, 40):  # prompts in chunks of 40: later chunks read earlier pages
                chunks = [(s, p[start : start + 40], start, pages[s]) for s, p in enumerate(prompts) if len(p) > start]
                cache.hold_hot([(tuple(pages[s]), start + len(t)) for s, t, _, _ in chunks])
                logits.append(model(ForwardBatch.build(chunks, logits="all"), cache))
            positions = [len(p) for p in prompts]
            for step in range(10):
                tokens = random_tokens(3, seed=40 + step)
                cache.hold_hot([(tuple(pages[s]), positions[s] + 1) for s in range(3)])
                if step % 2:
                    batch = DecodeBatch.build([(s, tokens[s], positions[s], pages[s]) for s in range(3)], width=slot_pages)
                    logits.append(model.decode(batch, cache, model.engram_rows(list(range(3)), tokens, positions, cache)))
                else:
                    logits.append(model(ForwardBatch.build([(s, [tokens[s]], positions[s], pages[s]) for s in range(3)]), cache))
                positions = [p + 1 for p in positions]
        outputs.append(logits)
    for step, (plain, tiered) in enumerate(zip(*outputs, strict=True)):
        assert torch.equal(plain, tiered), f"step {step}"
    return caches


@pytest.mark.parametrize("deterministic", [True, False])
def test_v41_logits_with_a_host_tier_equal_the_plain_cache_past_the_ring(checkpoints, deterministic):
    """The ring holds one page (16 tokens) of each sequence; contexts reach 130: most picked entries
    are read from the host tier."""
    caches = run_tiered(load_model(checkpoints["v41"]), hot_tokens=BLOCK, deterministic=deterministic)
    hot = caches[1].hot
    assert hot.ring_pages == 3 and len(hot.held) <= 3 and hot.filled_pages > 3


def test_host_tier_keeps_only_entries_in_host_memory(checkpoints):
    model = load_model(checkpoints["v41"])
    packed = ModelCache.allocate(model.config, 2, 64, num_pages=8, block_tokens=BLOCK, kv_cache_dtype="fp4")
    tiered = ModelCache.allocate(model.config, 2, 64, num_pages=8, block_tokens=BLOCK, kv_cache_dtype="fp4",
                                 host_tier=HostTierSpec(BLOCK, 2))
    assert tiered.page_bytes() == packed.page_bytes()
    sources = [layer.shared for layer in tiered.layers if layer.shared is not None]
    entry_bytes = sum(s.entries.host.codes[0].numel() + s.entries.host.scales[0].numel() for s in sources)
    assert tiered.host_tier_page_bytes() == entry_bytes > 0
    assert all(isinstance(s.entries, TieredPages) and not isinstance(s.index_keys, TieredPages) for s in sources)
    ring = sum(t.numel() * t.element_size() for t in tiered.ring_tensors())
    assert tiered.slot_bytes() == packed.slot_bytes() + ring


@pytest.mark.parametrize("kind", ["auto", "v4"])
def test_host_tier_is_refused_without_packed_v41_pages(checkpoints, kind):
    model = load_model(checkpoints["v41" if kind == "auto" else "mixed"])
    with pytest.raises(ValueError, match="offload.kv host_packed"):
        ModelCache.allocate(model.config, 2, 64, num_pages=8, block_tokens=BLOCK,
                            kv_cache_dtype="auto" if kind == "auto" else "fp4", host_tier=HostTierSpec(BLOCK, 2))


def test_a_page_copied_into_a_hot_page_is_read_back_from_the_ring(checkpoints):
    """Prefix-cache page copies write the host tier directly; a hot target's ring copy follows."""
    model = load_model(checkpoints["v41"])
    cache = ModelCache.allocate(model.config, 2, 64, num_pages=8, block_tokens=BLOCK, kv_cache_dtype="fp4",
                                host_tier=HostTierSpec(BLOCK, 2))
    stores = [layer.shared.entries for layer in cache.layers if layer.shared is not None]
    for store in stores:
        rows = store.shape[1]
        store.put(torch.full((rows,), 5), torch.arange(rows), torch.randn(rows, store.shape[2]))
    cache.hold_hot([((2,), 1)])
    cache.copy_pages([5], [2])
    for store in stores:
        index = torch.arange(store.shape[1])
        assert int(cache.hot.location[2]) >= 0
        assert torch.equal(store.at(torch.full_like(index, 2), index), store.host.at(torch.full_like(index, 5), index))


def test_plan_pages_budgets_the_host_tier_in_host_ram():
    from engine.admission import plan_pages

    common = dict(budget=1000, weights=0, workspace=0, slot_state=0, block_tokens=4, max_num_seqs=100,
                  max_model_len=100, pinned_pages=None)
    gpu = plan_pages(device="cuda", page_bytes=30, host_tier_page_bytes=20, host_budget=20 * 40, **common)
    assert gpu.page_bytes == 10 and gpu.num_pages == 40  # host RAM holds 40 pages, the GPU 100
    assert "host tier 20 B per page, 5 B per token" in gpu.describe()
    cpu = plan_pages(device="cpu", page_bytes=30, host_tier_page_bytes=20, host_budget=0, **common)
    assert cpu.page_bytes == 30 and cpu.num_pages == 33  # one memory: both tiers in its budget


def test_rig_plan_shows_bytes_per_token_per_tier(capsys):
    from tests.test_deploy_plan import plan_main

    args = ["--config", "configs/rtxpro6000x4.yaml", "--set", "memory.kv_cache_dtype=fp4"]
    status, packed, _ = plan_main(capsys, *args)
    assert status == 0
    status, tiered, _ = plan_main(capsys, *args, "--set", "offload.kv=host_packed")
    assert status == 0

    def per_token(text: str, label: str) -> int:
        line = next(line for line in text.splitlines() if line.strip().startswith(label))
        return int(line.split(" B per token")[0].rsplit("(", 1)[1].replace(",", ""))

    device, host = per_token(tiered, "KV  "), per_token(tiered, "KV host tier")
    assert "in host RAM" in tiered and device + host == per_token(packed, "KV  ") and host > 3 * device
    status, _, error = plan_main(capsys, "--config", "configs/rtxpro6000x4.yaml", "--set", "offload.kv=host_packed",
                                 "--set", "model.path=configs/models/DeepSeek-V4-Flash")
    assert status != 0 and "offload.kv host_packed" in error and "deepseek_v4" in error
