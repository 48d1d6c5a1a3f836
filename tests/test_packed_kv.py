"""Packed FP4 pages for V4.1's compressed KV entries and index keys (`memory.kv_cache_dtype: fp4`):
reads give back exactly what the unpacked cache holds, so a V4.1 model's logits are bitwise the same
with packing on, through the chunked forward and the decode path, in both modes. FP8 pages (`fp8`,
vLLM's fp8 / fp8_ds_mla): on V4 reads are the plain cache's values quantized-dequantized (e4m3, a
scale per 64, RoPE channels bf16) and logits stay close; on V4.1 fp8 is the fp4 packing."""

from __future__ import annotations

import pytest
import torch

from kernels import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0
from kernels.kv_pack import fake_quant_fp8
from models import DecodeBatch, ForwardBatch, ModelCache, load_model
from models.cache import paged_gather_rows
from models.packed_pages import FP8Codec, PackedPages
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


def run_both(model, deterministic: bool, kind: str = "fp4") -> None:
    """Prompts (every position's logits), then decode steps through the chunked forward and through the
    decode path, on a plain and a packed cache: bitwise the same at every position."""
    from contextlib import nullcontext

    from kernels.batch_invariant import BatchInvariantMode

    mode = BatchInvariantMode if deterministic else nullcontext
    pages = {slot: [11 - 3 * slot - i for i in range(3)] for slot in range(3)}
    caches = [ModelCache.allocate(model.config, 3, 48, num_pages=12, block_tokens=BLOCK, kv_cache_dtype=kind)
              for kind in ("auto", kind)]
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


def test_fp8_packed_pages_read_back_the_plain_values_quantized_dequantized():
    """Through block tables (put / at / pages, with `where`): every read is fake_quant_fp8 of what was
    written, entries with a bf16 RoPE tail and index keys without one."""
    for codec in (FP8Codec(tail=16), FP8Codec()):
        generator = torch.Generator().manual_seed(1)
        store = PackedPages.allocate(6, 4, 96, codec, torch.float32, "cpu")
        assert store.shape == (6, 4, 96) and store.scale_format == "fp8"
        assert [t.shape[-1] for t in store.tensors()] == ([80, 8, 32] if codec.tail else [96, 8])
        values = torch.randn(5, 96, generator=generator) * torch.logspace(-3, 2, 5)[:, None]
        page, index = torch.tensor([5, 0, 3, 3, 1]), torch.tensor([0, 3, 1, 2, 3])
        store.put(page, index, values)
        rounded = fake_quant_fp8(values, codec.tail)
        assert torch.equal(store.at(page, index), rounded)
        assert not torch.equal(rounded, values)
        where = torch.tensor([True, False, False, True, False])
        store.put(page, index, values * 7, where=where)
        expected = torch.where(where[:, None], fake_quant_fp8(values * 7, codec.tail), rounded)
        assert torch.equal(store.at(page, index), expected)
        assert torch.equal(store.pages(torch.tensor([[3]]))[0, 0, 1:3], expected[2:4])
        tables = torch.tensor([[0, 1], [5, 3]])  # paged_gather_rows, as the attention reads it
        assert torch.equal(paged_gather_rows(store, tables, torch.tensor([[3, 7], [0, 6]])),
                           torch.stack([expected[[1, 4]], expected[[0, 3]]]))


def tiny_v4(**overrides):
    from models import ModelConfig
    from models.random_model import build_random_model
    from models.tiny import tiny_config_dict

    return build_random_model(ModelConfig.from_dict(tiny_config_dict(**overrides)), torch.float32, "cpu", 0)


def test_v4_fp8_pages_hold_the_plain_cache_rounded_and_logits_stay_close():
    """The same prompts on a plain and an fp8 cache. The first paged layer sees the same inputs in both,
    so its fp8 pages read back exactly fake_quant_fp8 of the plain pages (entries with the 8 RoPE
    channels in bf16, index keys e4m3 throughout). Measured logits (tiny random V4: 24 e4m3 + 8 bf16
    channels an entry, all positions of two prompts): per position the logits' max error relative to
    their max was 0.65% at the median (fp4: 3.4%); 10 of 160 positions moved more than 5% (fp4: 49),
    41% at worst (fp4: 48%), presumably where a hard choice downstream (the indexer's top-k, the
    experts' routing) flipped on this random model; 95.6% of argmaxes agreed (fp4: 89%)."""
    model = tiny_v4(index_head_dim=32)
    prompts = [random_tokens(100, seed=1), random_tokens(60, seed=2)]
    caches, logits = {}, {}
    for kind in ("auto", "fp8", "fp4"):
        caches[kind] = ModelCache.allocate(model.config, 2, 128, num_pages=16, block_tokens=BLOCK, kv_cache_dtype=kind)
        batch = ForwardBatch.build([(0, prompts[0], 0, list(range(8))), (1, prompts[1], 0, list(range(8, 16)))], logits="all")
        logits[kind] = model(batch, caches[kind])
    first = next(i for i, layer in enumerate(caches["auto"].layers) if layer.compressor is not None)
    tables = torch.arange(16).view(2, 8)
    for pooler in ("compressor", "indexer"):
        plain, packed = (getattr(caches[kind].layers[first], pooler) for kind in ("auto", "fp8"))
        if plain is None:
            continue
        assert isinstance(packed.entries, PackedPages) and packed.entries.scale_format == "fp8"
        tail = model.config.rope_head_dim if pooler == "compressor" else 0
        assert torch.equal(packed.entries.pages(tables), fake_quant_fp8(plain.entries[tables], tail))
    plain = logits["auto"]
    error = {kind: (plain - logits[kind]).abs().amax(-1) / plain.abs().amax(-1) for kind in ("fp8", "fp4")}
    first_entry = min(r for r in model.config.compress_rates if r) - 1
    assert torch.equal(plain[:first_entry], logits["fp8"][:first_entry])
    assert error["fp8"].max() > 0 and error["fp8"].median() < 0.015 and (error["fp8"] > 0.05).sum() <= 16
    assert error["fp8"].median() * 3 < error["fp4"].median()
    assert (plain.argmax(-1) == logits["fp8"].argmax(-1)).float().mean() > 0.93


def v4_page_bytes(config, block_tokens: int, kind: str) -> int:
    """Bytes of one page counted from the config: per paged layer, block_tokens / rate entries (and
    index keys for CSA) of head_dim (index_head_dim) channels."""
    def entry(dim: int, tail: int) -> int:
        if kind == "auto":
            return 4 * dim  # float32
        body = dim - tail
        return body + 4 * -(-body // 64) + 2 * tail

    total = 0
    for rate, layer_type in zip(config.compress_rates, config.layer_types):
        if rate:
            per_page = block_tokens // rate
            total += per_page * entry(config.head_dim, config.rope_head_dim)
            if layer_type == "compressed_sparse_attention":
                total += per_page * entry(config.index_head_dim, 0)
    return total


def test_fp8_page_bytes_are_what_the_layout_says():
    model = tiny_v4()
    for kind in ("auto", "fp8"):
        cache = ModelCache.allocate(model.config, 2, 64, num_pages=4, block_tokens=BLOCK, kv_cache_dtype=kind)
        assert cache.page_bytes() == v4_page_bytes(model.config, BLOCK, kind), kind


def test_plan_counts_v4_flash_fp8_pages_and_v41_fp8_as_fp4(capsys):
    """V4-Flash (published config): a 512-wide entry 448 + 7 * 4 + 128 = 604 bytes, an index key
    128 + 8 = 136, against 1,024 and 256 in bf16. V4.1 fp8 is the fp4 packing: the same plan."""
    import json

    from engine.plan import cache_bytes
    from models import ModelConfig
    from tests.test_deploy_plan import plan_main, rig

    config, _, config_json = rig("h200x1", "memory.kv_cache_dtype=fp8")
    model_config = ModelConfig.from_dict(json.loads(config_json.read_text()))
    block = config.scheduler.block_tokens
    page, _, _ = cache_bytes(model_config, config, torch.bfloat16, config.model.max_model_len)
    assert page == v4_page_bytes(model_config, block, "fp8")
    plain, _, _ = cache_bytes(model_config, rig("h200x1")[0], torch.bfloat16, config.model.max_model_len)
    assert plain == v4_page_bytes(model_config, block, "auto") // 2  # bf16
    assert 1.6 < plain / page < 1.8

    outputs = {}
    for kind in ("fp4", "fp8"):
        status, outputs[kind], _ = plan_main(capsys, "--config", "configs/cpu-tiny.yaml", "--set", f"memory.kv_cache_dtype={kind}")
        assert status == 0
    assert outputs["fp4"] == outputs["fp8"].replace("kv_cache_dtype fp8", "kv_cache_dtype fp4")


def test_v41_fp8_is_the_fp4_packing_bitwise_the_plain_cache(checkpoints):
    """fp8 on V4.1 stores the fp4 packing (its entries are FP4 values: e4m3 per 64 would round them
    and take more bytes); without V4.1's simulated rounding (a reference mode) it is e4m3."""
    model = load_model(checkpoints["v41"])
    cache = ModelCache.allocate(model.config, 2, 32, num_pages=4, block_tokens=BLOCK, kv_cache_dtype="fp8")
    fp4 = ModelCache.allocate(model.config, 2, 32, num_pages=4, block_tokens=BLOCK, kv_cache_dtype="fp4")
    assert {layer.shared.entries.scale_format for layer in cache.layers if layer.shared} == {"e4m3"}
    assert cache.page_bytes() == fp4.page_bytes()
    run_both(model, deterministic=True, kind="fp8")
    reference = load_model(checkpoints["v41"], simulate_quantization=False).config
    cache = ModelCache.allocate(reference, 2, 32, num_pages=4, block_tokens=BLOCK, kv_cache_dtype="fp8")
    assert {layer.shared.entries.scale_format for layer in cache.layers if layer.shared} == {"fp8"}
    with pytest.raises(ValueError, match="choose from"):
        ModelCache.allocate(model.config, 2, 32, kv_cache_dtype="fp8_ds_mla")  # the CLI's spelling only


def test_v4_decode_path_over_fp8_pages_equals_the_chunked_forward():
    """tests/test_decode_path.py's check over fp8 pages: the decode path (what CUDA graphs capture)
    and the chunked forward agree to float-sum order, and so do the values their pages read back (a
    float32 scale's last bits may differ, so the bytes are not compared)."""
    from tests.test_decode_path import WIDTH, build

    torch.manual_seed(0)
    model = build(index_head_dim=32)
    starts = [0, 5, 23, 40]
    pages = {slot: [17 - 4 * slot - i for i in range(4)] for slot in range(4)}
    caches = [ModelCache.allocate(model.config, 4, 64, num_pages=18, block_tokens=BLOCK, kv_cache_dtype="fp8")
              for _ in range(2)]
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate(starts)]
    for cache in caches:
        model(ForwardBatch.build([(slot, prompt, 0, pages[slot]) for slot, prompt in enumerate(prompts) if prompt]), cache)
    eager, graphable = caches
    positions = list(starts)
    for step in range(24):
        tokens = random_tokens(4, seed=100 + step)
        expected = model(ForwardBatch.build([(s, [tokens[s]], positions[s], pages[s]) for s in range(4)]), eager)
        actual = model.decode(DecodeBatch.build([(s, tokens[s], positions[s], pages[s]) for s in range(4)], width=WIDTH),
                              graphable)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        positions = [p + 1 for p in positions]
    everything = torch.arange(18)
    for a, b in zip(eager.layers, graphable.layers, strict=True):
        for pooler in ("compressor", "indexer"):
            if getattr(a, pooler) is not None:
                packed = getattr(b, pooler).entries
                assert isinstance(packed, PackedPages) and packed.scale_format == "fp8"
                torch.testing.assert_close(packed.pages(everything), getattr(a, pooler).entries.pages(everything),
                                           rtol=1e-4, atol=1e-5)


def test_engine_with_fp8_pages_generates_close_to_the_plain_cache(checkpoints):
    """Through the scheduler and runner on the tiny V4 checkpoint: greedy tokens and their logprobs
    with fp8 pages against the plain cache (a prefix-cache hit included)."""
    from contract import NewRequest, SamplingParams
    from tests.test_prefix_cache import make_engine, run

    model = load_model(checkpoints["mixed"])
    prompt = random_tokens(90, seed=37)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for kind in ("auto", "fp8"):
        engine, outputs = make_engine(model, kv_cache_dtype=kind)
        run(engine, outputs, [NewRequest("first", prompt[:37], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
        run(engine, outputs, [NewRequest("r", prompt, params)])
        results[kind] = outputs
    plain, fp8 = results["auto"], results["fp8"]
    assert fp8.cached("r") == 37
    assert fp8.tokens("r")[:4] == plain.tokens("r")[:4]
    for a, b in zip(plain.logprobs("r")[:4], fp8.logprobs("r")[:4]):
        assert abs(a.logprob - b.logprob) < 0.05
