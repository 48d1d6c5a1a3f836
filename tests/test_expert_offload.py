"""Expert offload's cache (models/expert_offload.py, issue 28): experts split between the device and host
RAM give the resident layer's output bitwise (whole models too, V4 and V4.1, dense and MXFP4 experts),
the tiers' accounting holds after every step, rebalancing follows the measured routing, and a step with
more host experts than staging slots runs in waves."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import torch

from kernels.batch_invariant import BatchInvariantMode
from kernels.moe import MXFP4Experts
from models import ForwardBatch, ModelCache, load_model
from models.config import ModelConfig
from models.expert_offload import OffloadedExperts, offload_experts
from models.moe import Experts
from models.random_model import quantize_as_released
from models.tiny import tiny_config_dict


def layer(packed: bool, seed: int = 0) -> Experts:
    config = ModelConfig.from_dict(tiny_config_dict())
    experts = Experts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for leaf in ("gate_up_proj", "down_proj"):
            weight = experts.weights(leaf)
            weight.copy_(torch.randn(weight.shape, generator=generator) / weight.shape[-1] ** 0.5)
    if packed:
        model = torch.nn.Module()
        model.experts = experts
        quantize_as_released(model)
    return experts


def routing(tokens: int, k: int, held: int, generator: torch.Generator, skew: float = 0.0):
    """(weights, expert ids) of `tokens` tokens, top-k of `held` experts; `skew` favours low ids."""
    scores = torch.rand(tokens, held, generator=generator) - skew * torch.arange(held) / held
    ids = scores.topk(k, dim=-1).indices
    return torch.rand(tokens, k, generator=generator), ids


def same_weights(cache: OffloadedExperts, experts: Experts) -> bool:
    """Every expert's tensors, wherever the cache holds it, equal the layer's own."""
    for expert in range(experts.held):
        held = cache.expert_weights(expert)
        for leaf in OffloadedExperts.LEAVES:
            source = experts.weights(leaf)
            packed = isinstance(source, MXFP4Experts)
            originals = (source.codes[expert], source.scales[expert]) if packed else (source[expert],)
            if not all(torch.equal(a, b) for a, b in zip(held[leaf], originals)):
                return False
    return True


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "mxfp4"])
def test_an_offloaded_layer_is_bitwise_the_resident_one(packed):
    experts = layer(packed)
    cache = OffloadedExperts(experts, resident=3, staging=4, rebalance_every=5)
    generator = torch.Generator().manual_seed(1)
    k, held = 2, experts.held
    for step in range(24):
        tokens = 1 + step % 2  # decode-sized steps: at most 4 host experts, the staging slots
        x = torch.randn(tokens, experts.gate_up_proj_codes.shape[-1] * 2 if packed else experts.gate_up_proj.shape[-1],
                        generator=generator)
        weights, ids = routing(tokens, k, held, generator, skew=1.0)
        residual = torch.randn_like(x) if step % 3 == 0 else None
        want = experts(x, weights, ids, residual)
        got = cache(x, weights, ids, residual)
        assert torch.equal(got, want), step
        assert cache.tiers_hold_every_expert(), step
        stats = cache.stats
        assert stats.pairs == stats.resident_pairs + stats.staged_pairs == sum(1 + s % 2 for s in range(step + 1)) * k
    assert cache.stats.copies > 0 and cache.stats.staging_hits > 0 and cache.stats.swaps > 0
    assert cache.stats.copied_bytes == cache.stats.copies * cache.bytes_per_expert
    assert same_weights(cache, experts)  # the copies and swaps moved every byte exactly


def test_rebalancing_keeps_the_most_routed_experts_resident():
    experts = layer(packed=False)
    cache = OffloadedExperts(experts, resident=2, staging=4, rebalance_every=1000, order=[0, 1, 2, 3, 4, 5, 6, 7])
    x = torch.randn(1, experts.gate_up_proj.shape[-1])
    for _ in range(10):  # experts 6 and 7 are the hot ones, 0 and 1 (resident) never routed
        cache(x, torch.ones(1, 2), torch.tensor([[6, 7]]))
    assert cache.rebalance() == 2 and cache.tiers_hold_every_expert()
    assert sorted(e for e in range(8) if 0 <= cache.slot_of[e] < cache.resident) == [6, 7]
    before = cache.stats.copies
    cache(x, torch.ones(1, 2), torch.tensor([[6, 7]]))
    assert cache.stats.copies == before and cache.stats.resident_pairs >= 2  # now served without a copy
    assert same_weights(cache, experts)


def test_a_step_past_the_staging_slots_runs_in_waves():
    experts = layer(packed=False)
    cache = OffloadedExperts(experts, resident=1, staging=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, experts.gate_up_proj.shape[-1], generator=generator)
    weights, ids = routing(16, 2, experts.held, generator)  # a prompt chunk: nearly every expert
    residual = torch.randn_like(x)
    got, want = cache(x, weights, ids, residual), experts(x, weights, ids, residual)
    assert cache.stats.waves >= 3 and cache.tiers_hold_every_expert()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the waves' sum rounds on its own


def test_other_ranks_pairs_are_left_out():
    """Under tensor parallelism a rank holds a run of the experts: pairs of the others add nothing."""
    experts = layer(packed=False)
    experts.first = 4  # this rank's experts are ids 4 .. 11
    cache = OffloadedExperts(experts, resident=2, staging=4)
    x = torch.randn(3, experts.gate_up_proj.shape[-1])
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 5], [9, 11], [2, 3]])
    assert torch.equal(cache(x, weights, ids), experts(x, weights, ids))
    assert cache.stats.pairs == 3


def full_forward(model, token_ids: list[int]) -> torch.Tensor:
    return model(ForwardBatch.build([(0, token_ids, 0)], logits="all"), ModelCache.allocate(model.config, 1, 64))


@pytest.mark.parametrize("name, packed, deterministic", [
    ("mixed", False, False), ("mixed", True, False), ("v41", False, False), ("mixed", False, True), ("v41", True, True),
])
def test_a_model_with_offloaded_experts_gives_the_resident_logits(checkpoints, name, packed, deterministic):
    """Whole tiny models, a prompt whose host experts fit the staging slots: bitwise (the loader's
    tensors are 64-byte aligned as the cache's stacks are: CPU GEMMs round by alignment)."""
    model, offloaded = load_model(checkpoints[name]), load_model(checkpoints[name])
    if packed:
        quantize_as_released(model)
        quantize_as_released(offloaded)
    held = model.config.n_routed_experts
    layers = offload_experts(offloaded, resident_per_layer=2, staging=held - 2)
    assert layers == sum(1 for m in model.modules() if isinstance(m, Experts))
    tokens = list(range(5, 17))
    with BatchInvariantMode() if deterministic else contextlib.nullcontext():
        assert torch.equal(full_forward(offloaded, tokens), full_forward(model, tokens))
    caches = [m for m in offloaded.modules() if isinstance(m, OffloadedExperts)]
    assert all(c.tiers_hold_every_expert() and c.stats.pairs > 0 for c in caches)


def test_the_loader_hands_out_aligned_weights(checkpoints):
    model = load_model(checkpoints["mixed"])
    assert all(t.data_ptr() % 64 == 0 for t in list(model.parameters()) + list(model.buffers()) if t.numel())


def test_a_server_with_offloaded_experts_answers_as_the_resident_one(checkpoints):
    """Through HTTP with the openai client, deterministic mode, 3 requests at once: a server keeping 2 of
    8 experts a layer resident (6 staged per step) gives the resident server's tokens and bitwise its
    logprobs; its plan places the experts as `plan` prints."""
    from tests.serving import running_server
    from tests.test_spec_engine import completions

    common = ("--deterministic", "--max-model-len", "256")
    with running_server(checkpoints["mixed"], "spec", *common) as base:
        plain = completions(base)
    offload = ("--set", "offload.experts=host", "--set", "offload.gpu_experts_per_layer=2",
               "--set", "offload.staging_experts=8")
    with running_server(checkpoints["mixed"], "spec", *common, *offload) as base:
        assert completions(base) == plain
        text = httpx.get(base + "/metrics").text
    figures = {line.split("{")[0] + (line.split('tier="')[1].split('"')[0] if 'tier="' in line else ""):
               float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("ds4serve:expert_offload")}
    assert figures["ds4serve:expert_offload_pairs_totalstaged"] > 0 and figures["ds4serve:expert_offload_copies_total"] > 0
    assert figures["ds4serve:expert_offload_bytes_copied_total"] > 0


@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
def test_the_loaders_offload_each_layer_as_its_experts_arrive(checkpoints, tmp_path, dummy):
    """With `experts_loaded`, a layer's experts are offloaded before the next layer's are read (the
    device never holds them all) and the model equals one offloaded after loading, bitwise."""
    from models.dummy_weights import build_dummy_model
    from models.expert_offload import LayerOffload

    directory = checkpoints["mixed"]
    later_meta = []

    class Watch(LayerOffload):
        def __call__(self, model, moe_name):
            super().__call__(model, moe_name)
            later = [m for n, m in model.named_modules() if isinstance(m, Experts) and n > moe_name]
            later_meta.append(all(m.gate_up_proj.is_meta for m in later))

    watch = Watch(resident=2, staging=6)
    if dummy:
        streamed, whole = (build_dummy_model(directory, seed=3, experts_loaded=watch), build_dummy_model(directory, seed=3))
    else:
        streamed, whole = load_model(directory, experts_loaded=watch), load_model(directory)
    layers = offload_experts(whole, resident_per_layer=2, staging=6)
    assert watch.layers == layers == streamed.config.num_layers and all(later_meta)
    tokens = list(range(5, 17))
    assert torch.equal(full_forward(streamed, tokens), full_forward(whole, tokens))
