"""Packed FP4 pages for V4.1's compressed KV entries and index keys (`memory.kv_cache_dtype: fp4`):
reads give back exactly what the unpacked cache holds, so a V4.1 model's logits are bitwise the same
with packing on, through the chunked forward and the decode path, in both modes."""

from __future__ import annotations

import pytest
import torch

from kernels import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0
from models import DecodeBatch, ForwardBatch, ModelCache, load_model
from models.packed_pages import PackedPages
from tests.conftest import random_tokens

BLOCK = 16


@pytest.mark.parametrize("scale_format, rounding", [("e4m3", fake_quant_fp4_e4m3), ("ue8m0", fake_quant_fp4_ue8m0)])
def test_packed_pages_read_back_the_models_rounding(scale_format, rounding):
    generator = torch.Generator().manual_seed(0)
    store = PackedPages.allocate(6, 4, 64, scale_format, torch.float32, "cpu")
    values = torch.randn(5, 64, generator=generator) * torch.logspace(-3, 2, 5)[:, None]
    page, index = torch.tensor([5, 0, 3, 3, 1]), torch.tensor([0, 3, 1, 2, 3])
    store.put(page, index, values)
    assert torch.equal(store.at(page, index), rounding(values))
    kept = store.at(page, index)
    store.put(page, index, values * 7, where=torch.tensor([True, False, False, True, False]))
    expected = torch.where(torch.tensor([True, False, False, True, False])[:, None], rounding(values * 7), kept)
    assert torch.equal(store.at(page, index), expected)
    assert torch.equal(store.pages(torch.tensor([[3]]))[0, 0, 1:3], expected[2:4])


def run_both(model, deterministic: bool) -> None:
    """Prompts (every position's logits), then decode steps through the chunked forward and through the
    decode path, on a plain and a packed cache: bitwise the same at every position."""
    from contextlib import nullcontext

    from kernels.batch_invariant import BatchInvariantMode

    mode = BatchInvariantMode if deterministic else nullcontext
    pages = {slot: [11 - 3 * slot - i for i in range(3)] for slot in range(3)}
    caches = [ModelCache.allocate(model.config, 3, 48, num_pages=12, block_tokens=BLOCK, kv_cache_dtype=kind)
              for kind in ("auto", "fp4")]
    assert isinstance(next(layer.shared for layer in caches[1].layers if layer.shared).entries, PackedPages)
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate([9, 20, 31])]
    outputs = []
    for cache in caches:
        logits = []
        with mode():
            logits.append(model(ForwardBatch.build([(s, p, 0, pages[s]) for s, p in enumerate(prompts)], logits="all"), cache))
            positions = [len(p) for p in prompts]
            for step in range(8):
                tokens = random_tokens(3, seed=40 + step)
                if step % 2:
                    batch = DecodeBatch.build([(s, tokens[s], positions[s], pages[s]) for s in range(3)], width=4)
                    rows = model.engram_rows(list(range(3)), tokens, positions, cache)
                    logits.append(model.decode(batch, cache, rows))
                else:
                    logits.append(model(ForwardBatch.build([(s, [tokens[s]], positions[s], pages[s]) for s in range(3)]), cache))
                positions = [p + 1 for p in positions]
        outputs.append(logits)
    for step, (plain, packed) in enumerate(zip(*outputs, strict=True)):
        assert torch.equal(plain, packed), f"step {step}"


@pytest.mark.parametrize("deterministic", [True, False])
def test_v41_logits_with_packed_pages_equal_the_plain_cache(checkpoints, deterministic):
    run_both(load_model(checkpoints["v41"]), deterministic)


def test_packed_pages_take_a_seventh_of_float32_pages(checkpoints):
    model = load_model(checkpoints["v41"])
    plain = ModelCache.allocate(model.config, 2, 32, num_pages=4, block_tokens=BLOCK)
    packed = ModelCache.allocate(model.config, 2, 32, num_pages=4, block_tokens=BLOCK, kv_cache_dtype="fp4")
    # entries: dim/2 code bytes + dim/16 scales against 4 * dim; index keys: dim/2 + dim/32 against 4 * dim
    assert packed.page_bytes() * 6 < plain.page_bytes() < packed.page_bytes() * 8


def test_fp4_is_refused_for_v41_without_its_simulated_quantization(checkpoints):
    with pytest.raises(ValueError, match="simulated"):
        ModelCache.allocate(load_model(checkpoints["v41"], simulate_quantization=False).config, 2, 32, kv_cache_dtype="fp4")


def test_v4_packing_is_lossy_and_measured():
    """V4 does not round its cache, so fp4 (opt-in) rounds its compressed entries and index keys.
    Measured on a tiny random V4 (head_dim 32, scales per 16), every position of two prompts: the
    positions before the first compressed entry are untouched; per position the logits' max error
    relative to their max was 3.4% at the median and 48% at worst, and 89% of argmaxes agreed."""
    from models import ModelConfig
    from models.random_model import build_random_model
    from models.tiny import tiny_config_dict

    model = build_random_model(ModelConfig.from_dict(tiny_config_dict(index_head_dim=32)), torch.float32, "cpu", 0)
    prompts = [random_tokens(100, seed=1), random_tokens(60, seed=2)]
    logits = []
    for kind in ("auto", "fp4"):
        cache = ModelCache.allocate(model.config, 2, 128, num_pages=16, block_tokens=BLOCK, kv_cache_dtype=kind)
        batch = ForwardBatch.build([(0, prompts[0], 0, list(range(8))), (1, prompts[1], 0, list(range(8, 16)))], logits="all")
        logits.append(model(batch, cache))
    assert cache.page_bytes() * 7 < ModelCache.allocate(model.config, 2, 128, num_pages=16, block_tokens=BLOCK).page_bytes()
    plain, packed = logits
    error = (plain - packed).abs().amax(-1) / plain.abs().amax(-1)
    first_entry = min(r for r in model.config.compress_rates if r) - 1  # the first pooled entry closes here
    assert torch.equal(plain[:first_entry], packed[:first_entry])
    assert error.median() < 0.1 and error.max() > 0
    assert (plain.argmax(-1) == packed.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("hot_tokens", [None, BLOCK])
def test_engine_with_packed_pages_serves_a_prefix_hit_like_the_plain_cold_run(checkpoints, hot_tokens):
    """Through the scheduler and runner: a prefix-cache hit (pages shared, a partial page copied, all
    packed) then decoding, bitwise the plain cache's cold run in deterministic mode; also with the
    entries in the host tier behind a one-page ring (`hot_tokens`; the runner holds the ring before
    each step, and the partial page is copied into the host tier)."""
    from contract import NewRequest, SamplingParams
    from tests.test_prefix_cache import clobber, full_logprobs, make_engine, run

    model = load_model(checkpoints["v41"])
    prompt = random_tokens(90, seed=37)
    cold_engine, cold = make_engine(model)
    run(cold_engine, cold, [NewRequest("cold", prompt, full_logprobs(model))])
    engine, warm = make_engine(model, kv_cache_dtype="fp4", kv_hot_tokens=hot_tokens)
    run(engine, warm, [NewRequest("first", prompt[:37], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
    clobber(engine, warm)
    run(engine, warm, [NewRequest("warm", prompt, full_logprobs(model))])
    assert warm.cached("warm") == 37
    assert warm.tokens("warm") == cold.tokens("cold") and warm.logprobs("warm") == cold.logprobs("cold")


def test_plan_shows_packed_bytes_per_token(capsys):
    from tests.test_deploy_plan import plan_main

    status, plain, _ = plan_main(capsys, "--config", "configs/cpu-tiny.yaml")
    assert status == 0
    status, packed, _ = plan_main(capsys, "--config", "configs/cpu-tiny.yaml", "--set", "memory.kv_cache_dtype=fp4")
    assert status == 0

    def per_token(text: str) -> int:
        return int(text.split(" B per token")[0].rsplit("(", 1)[1].replace(",", ""))

    assert per_token(packed) * 7 < per_token(plain)
