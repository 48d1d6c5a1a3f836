"""On the lent GPU (`pytest -m gpu`): the CUDA forward against the CPU reference, Engram tiers on the
device, and no new device allocations after warm-up. CPU CI skips these."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from contract import EngineLimits, NewRequest, SamplingParams
from engram_store.store import EngramOptions
from models import ForwardBatch, ModelCache, load_model
from scheduler import Scheduler
from tests.conftest import random_tokens, relative_error
from tests.test_v41_golden import GOLDEN
from worker import ModelRunner

try:  # the MXFP4 PTX decode's exactness test compiles a small kernel around it
    import triton
    import triton.language as tl

    from kernels.moe_mxfp4 import _mxfp4_as_bf16_ptx
except ImportError:  # no Triton: these tests are skipped with the rest
    triton = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def exact_float32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def forward(model, sequences):
    cache = ModelCache.allocate(model.config, len(sequences), 256, device=model.lm_head.weight.device)
    return model(ForwardBatch.build([(i, s, 0) for i, s in enumerate(sequences)], logits="all"), cache).cpu()


@pytest.mark.parametrize("name", ["mixed", "v41", "v41_variant"])
def test_cuda_forward_matches_the_cpu_reference(checkpoints, name):
    prompts = [random_tokens(70, seed=1), random_tokens(33, seed=2)]
    cpu = forward(load_model(checkpoints[name], simulate_quantization=False), prompts)
    gpu = forward(load_model(checkpoints[name], device="cuda", simulate_quantization=False), prompts)
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=1e-4)


@pytest.mark.skipif(not GOLDEN.exists(), reason="golden data absent")
def test_golden_v41_greedy_tokens_on_cuda():
    model = load_model(GOLDEN, device="cuda")
    inputs = json.loads((GOLDEN / "golden_inputs_and_generation.json").read_text())
    for name in ("seq0", "seq1", "seq2"):
        sequence = inputs["sequences"][name]
        ids = sequence["input_ids"]
        cache = ModelCache.allocate(model.config, 1, 128, device="cuda")
        logits = model(ForwardBatch.build([(0, ids, 0)]), cache)
        tokens = []
        for step in range(12):
            tokens.append(int(logits[0].argmax()))
            logits = model(ForwardBatch.build([(0, [tokens[-1]], len(ids) + step)]), cache)
        assert tokens == sequence["greedy_new_tokens"], name


def test_engram_tiers_agree_on_cuda(checkpoints, tmp_path):
    prompts = [random_tokens(50, seed=3), random_tokens(50, seed=3)]
    reference = forward(load_model(checkpoints["v41"], device="cuda", engram=EngramOptions(residency="gpu")), prompts)
    for options in (EngramOptions(residency="host"),
                    EngramOptions(residency="disk", path=tmp_path / "t", host_cache_bytes=1 << 14, gpu_cache_bytes=1 << 13)):
        model = load_model(checkpoints["v41"], device="cuda", engram=options)
        assert torch.equal(forward(model, prompts), reference)
        assert torch.equal(forward(model, prompts), reference)  # warm caches


def served_decode(model, cuda_graphs: bool, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, dict, dict]:
    """Four greedy requests through the scheduler: 50 steps of warm-up, then 300 decode steps between
    two readings of torch.cuda.memory_stats. Returns (runner, before, after)."""
    limits = EngineLimits(4, 64, 600, model.config.vocab_size, (), block_tokens=16)
    runner = ModelRunner(model, 4, 600, device="cuda", num_pages=limits.total_pages, block_tokens=16, max_logit_rows=64,
                         cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype)
    scheduler = Scheduler(limits)
    for i in range(4):
        scheduler.add(NewRequest(f"r{i}", random_tokens(20, seed=i), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)))

    def step():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))

    for _ in range(50):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(300):
        step()
    torch.cuda.synchronize()
    return runner, before, torch.cuda.memory_stats()


def test_decode_makes_no_new_device_allocations(checkpoints):
    _, before, after = served_decode(load_model(checkpoints["v41"], device="cuda"), cuda_graphs=False)
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert after["segment.all.allocated"] == before["segment.all.allocated"]  # no new cudaMalloc


@pytest.mark.parametrize("deterministic", [False, True])
def test_prefix_cache_hit_on_the_device(checkpoints, deterministic):
    """A hit inside a compression group, the window wrapped, restored on the GPU: bitwise the cold run
    in deterministic mode, within 1e-4 (and the same greedy tokens) in the default one."""
    from tests.test_prefix_cache import clobber, full_logprobs, make_engine, run

    model = load_model(checkpoints["v41"], device="cuda")
    prompt = random_tokens(90, seed=37)
    cold_engine, cold = make_engine(model, deterministic=deterministic, device="cuda")
    run(cold_engine, cold, [NewRequest("cold", prompt, full_logprobs(model))])
    engine, warm = make_engine(model, deterministic=deterministic, device="cuda")
    run(engine, warm, [NewRequest("first", prompt[:37], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))])
    clobber(engine, warm)
    run(engine, warm, [NewRequest("warm", prompt, full_logprobs(model))])
    assert warm.cached("warm") == 37 and warm.tokens("warm") == cold.tokens("cold")
    if deterministic:
        assert warm.logprobs("warm") == cold.logprobs("cold")
    else:
        for a, b in zip(warm.logprobs("warm"), cold.logprobs("cold"), strict=True):
            assert max(abs(x - y) for (_, x), (_, y) in zip(sorted(a.top), sorted(b.top), strict=True)) < 1e-4


def nccl_rank(rank: int, world: int, port: int, jobs: list[tuple], out: Path) -> None:
    """One NCCL rank on cuda:<rank>: its shards of each job's model, the steps of tests/test_tp_model.py."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from models import TensorParallel
    from tests.test_tp_model import run_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        tp = TensorParallel.from_default_group()
        torch.save({name: run_steps(load_model(path, device=f"cuda:{rank}", simulate_quantization=simulate, tp=tp),
                                    prompts)
                    for name, path, simulate, prompts in jobs}, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_on_nccl_equals_one_gpu(tmp_path, world):
    """Issue 12: TP=2 / TP=4 over NCCL against TP=1 on one GPU (tiny V4 and V4.1 with o_groups = 4, so
    that every sharded size divides by 4). Skipped where fewer GPUs are lent."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    from models.tiny import build_tiny_checkpoint
    from tests.test_tp_model import PROMPTS, free_port, run_steps

    jobs = [(family, build_tiny_checkpoint(tmp_path / family, family=family, o_groups=4), False, PROMPTS)
            for family in ("v4", "v41")]
    mp.spawn(nccl_rank, args=(world, free_port(), jobs, tmp_path), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for name, path, simulate, prompts in jobs:
        single = run_steps(load_model(path, device="cuda", simulate_quantization=simulate), prompts)
        for k, expected in enumerate(single):
            assert all(torch.equal(r[name][k], ranks[0][name][k]) for r in ranks), "ranks disagree"
            assert relative_error(ranks[0][name][k], expected) <= 1e-4, name
            assert torch.equal(ranks[0][name][k].argmax(-1), expected.argmax(-1)), name


def tiny_v4_bf16(seed: int = 0, wide: bool = False):
    """The tiny V4 in bf16 on the GPU; `wide`: hidden 256 and experts of 128, widths the CUDA MXFP4
    decode kernel takes (kernels/moe_mxfp4_mma.py: rows in 256s, columns in 128s)."""
    from models import ModelConfig
    from models.random_model import build_random_model
    from models.tiny import tiny_config_dict

    widths = {"hidden_size": 256, "moe_intermediate_size": 128} if wide else {}
    return build_random_model(ModelConfig.from_dict({**tiny_config_dict(), **widths}), torch.bfloat16, "cuda", seed)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_match_the_reference_loop(tokens):
    """CUTLASS grouped GEMMs against the per-expert loop on fresh random bf16 inputs; this rank holds
    experts [8, 24) of 32, so other ranks' choices must add nothing."""
    from kernels.moe import experts_grouped, experts_reference

    generator = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, 256, device="cuda", generator=generator).bfloat16()
    experts = torch.randint(0, 32, (tokens, 6), device="cuda", generator=generator)
    weights = torch.rand(tokens, 6, device="cuda", generator=generator)
    gate_up = (torch.randn(16, 256, 256, device="cuda", generator=generator) / 16).bfloat16()
    down = (torch.randn(16, 256, 128, device="cuda", generator=generator) / 11).bfloat16()
    for before_down in (False, True):
        args = (x, weights, experts, gate_up, down, 8, 7.0, before_down)
        torch.testing.assert_close(experts_grouped(*args), experts_reference(*args), rtol=2e-2, atol=2e-2)


def dequantized_float32(released, dense):
    """`dense` (a model of the same config) holding the values of `released`'s packed weights, in float32."""
    from kernels.quant import dequantize_fp8_blocks
    from models.layers import Fp8Linear
    from models.moe import Experts

    for name, module in released.named_modules():
        if isinstance(module, Experts):
            target = dense.get_submodule(name)
            for leaf in ("gate_up_proj", "down_proj"):
                packed = module.weights(leaf)
                getattr(target, leaf).data = torch.stack([packed.expert(e, torch.float32) for e in range(packed.shape[0])])
        elif isinstance(module, Fp8Linear):
            dense.get_submodule(name).weight.data = dequantize_fp8_blocks(module.weight, module.weight_scale)
    return dense.float()


def graph_test_models(kind: str, checkpoints) -> tuple:
    """(bf16 model, float32 reference with the same weights) of a tiny V4 or V4.1 (Engram on)."""
    import copy

    if kind in ("v4", "v4_fp8"):
        model = tiny_v4_bf16()
        return model, copy.deepcopy(model).float()
    if kind in ("v4_released", "v4_released_mma"):  # MXFP4 experts and FP8 linears kept packed; the
        from models.random_model import quantize_as_released  # reference holds their values

        wide = kind == "v4_released_mma"  # experts the runner lays out for the CUDA decode kernel
        model = tiny_v4_bf16(wide=wide)
        quantize_as_released(model)
        return model, dequantized_float32(model, tiny_v4_bf16(wide=wide))
    load = lambda dtype: load_model(checkpoints["v41"], dtype=dtype, device="cuda", simulate_quantization=False)
    return load(torch.bfloat16), load(torch.float32)


@pytest.mark.parametrize("kind", ["v4", "v41", "v4_released", "v4_released_mma", "v4_fp8"])
def test_decode_graph_replay_equals_eager_and_follows_the_forward(checkpoints, kind):
    """Each replay is bitwise an eager run of the same decode batch on the same state (cache and
    Engram rows included). Against a float32 model fed the same tokens, the graph path (Triton
    kernels, float32 inside) stays as close as the eager bf16 forward does: both drift from float32
    only by bf16 rounding, compounding through the caches. `v4_fp8`: V4 with fp8 KV pages (e4m3 and
    a scale per 64, lossy) on both the graphed and the eager runner, against the plain float32 cache."""
    from bench.decode import pages_holding
    from worker.cuda_graphs import DecodeRow

    model, reference_model = graph_test_models(kind, checkpoints)
    kv = "fp8" if kind == "v4_fp8" else "auto"
    graphed = ModelRunner(model, 4, 256, device="cuda", cuda_graphs=True, kv_cache_dtype=kv)
    eager = ModelRunner(model, 4, 256, device="cuda", cuda_graphs=False, kv_cache_dtype=kv)
    exact = ModelRunner(reference_model, 4, 256, device="cuda")
    assert graphed.graphs is not None and eager.graphs is None
    from models.moe import Experts

    laid_out = [m.mma_layout for m in model.modules() if isinstance(m, Experts)]
    assert all(laid_out) == (kind == "v4_released_mma") and laid_out
    positions = [5, 23, 40]
    for runner in (graphed, eager, exact):
        for slot, n in enumerate(positions):
            runner.model(ForwardBatch.build([(slot, random_tokens(n, seed=slot), 0)]), runner.cache)
    graph_errors, eager_errors = [], []
    for step in range(24):
        tokens = random_tokens(3, seed=50 + step)
        rows = [DecodeRow(s, tokens[s], positions[s], pages_holding(graphed, s, positions[s] + 1)) for s in range(3)]
        cache = graphed.cache
        before = [t.clone() for t in cache.tensors()]
        replayed = graphed.graphs.run(rows).clone()
        after = [t.clone() for t in cache.tensors()]
        for tensor, saved in zip(cache.tensors(), before):
            if tensor is not cache.engram_context:  # the look-back advanced when the rows were fetched
                tensor.copy_(saved)
        again = graphed.graphs.decode_eagerly(*graphed.graphs.bucket(rows))[:3]
        assert torch.equal(replayed, again), f"step {step}"
        assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), after)), f"step {step}"
        batch = ForwardBatch.build([(s, [tokens[s]], positions[s]) for s in range(3)])
        reference = exact.model(batch, exact.cache)
        graph_errors.append(relative_error(replayed, reference))
        eager_errors.append(relative_error(model(batch, eager.cache), reference))
        positions = [p + 1 for p in positions]
    assert graphed.graphs.replays == 24
    assert max(graph_errors) <= 1.5 * max(eager_errors) + 1e-3, (graph_errors, eager_errors)


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_a_mixed_step_replays_its_decodes_and_equals_them_run_apart(checkpoints, kind):
    """Issue 22 item 3: a step with decodes and a prompt chunk replays the decode graph for the
    decodes and runs the prompt eagerly. Its draws (tokens and logprobs) are bitwise those of the
    same decodes as a pure graph step plus the prompt chunk alone, on a twin runner: splitting the
    step changes nothing but the launches."""
    from contract import ScheduledChunk, StepPlan

    model = graph_test_models(kind, checkpoints)[0]
    runners = [ModelRunner(model, 4, 256, device="cuda", cuda_graphs=True) for _ in range(2)]
    params = SamplingParams(temperature=0.0, logprobs=3)
    prompts = [random_tokens(n, seed=slot) for slot, n in enumerate([5, 23, 40, 70])]

    def chunk(runner: ModelRunner, slot: int, tokens: list[int], position: int) -> ScheduledChunk:
        pages = tuple(runner.cache.default_pages(slot).tolist())
        return ScheduledChunk(f"r{slot}", slot, pages, tuple(tokens), position, True, (), params, position)

    for runner in runners:
        runner.execute(StepPlan(tuple(chunk(runner, s, prompts[s], 0) for s in range(3))))
    for step in range(3):
        decodes = [[chunk(r, s, [7 + s + step], len(prompts[s]) + step) for s in range(3)] for r in runners]
        prompt = [chunk(r, 3, prompts[3][10 * step : 10 * step + 10], 10 * step) for r in runners]
        mixed = runners[0].execute(StepPlan((decodes[0][0], prompt[0], *decodes[0][1:])))
        apart_decodes = runners[1].execute(StepPlan(tuple(decodes[1])))
        apart_prompt = runners[1].execute(StepPlan((prompt[1],)))
        expected = (apart_decodes.chunks[0], apart_prompt.chunks[0], *apart_decodes.chunks[1:])
        assert mixed.chunks == expected, f"step {step}"
    assert runners[0].graphs.replays == runners[1].graphs.replays == 3


@pytest.mark.parametrize("kind", ["v4", "v41", "v4_released", "v4_released_mma", "v4_fp8"])
def test_graph_decode_makes_no_allocation(checkpoints, kind):
    """A served decode run on graphs: after warm-up no new device memory (num_device_alloc, reserved
    bytes), and a replay alone asks the caching allocator for nothing (V4.1: its Engram rows are
    fetched into the static buffers outside that last check)."""
    from worker.cuda_graphs import DecodeRow

    kv = "fp8" if kind == "v4_fp8" else "auto"
    runner, before, after = served_decode(graph_test_models(kind, checkpoints)[0], cuda_graphs=True, kv_cache_dtype=kv)
    assert runner.graphs.replays >= 300
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    spare = DecodeRow(runner.graphs.scratch_slot, 5, 0, (runner.graphs.scratch_page,))
    graph = runner.graphs.graphs[(*runner.graphs.bucket([spare]), 1)]
    requests = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == requests


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_kernels_compiled_equal_their_references(seed):
    """The comparisons of tests/test_triton_kernels.py, compiled for the GPU, at V4-Flash widths too."""
    from tests.test_triton_kernels import (
        check_argmax_logprob,
        check_hc_mixes,
        check_hc_site_and_merge,
        check_rms_norm,
        check_rms_norm_rope,
        check_router,
    )

    check_hc_mixes(4, tokens=33, seed=seed, device="cuda")
    check_argmax_logprob(rows=33, vocab=129280, seed=seed, device="cuda")  # V4's vocabulary
    for dtype in (torch.float32, torch.bfloat16):
        check_router(tokens=33, experts=256, dim=4096, top_k=6, dtype=dtype, seed=seed, device="cuda")  # V4-Flash
        check_router(tokens=300, experts=256, dim=4096, top_k=6, dtype=dtype, seed=seed, device="cuda")  # in tiles
    for dtype in (torch.float32, torch.bfloat16):
        check_hc_site_and_merge(4, tokens=33, dim=4096, dtype=dtype, seed=seed, device="cuda")  # V4-Flash widths
        check_hc_site_and_merge(4, tokens=300, dim=4096, dtype=dtype, seed=seed, device="cuda")  # a prefill chunk's tiles
        check_hc_site_and_merge(4, tokens=1, dim=1100, dtype=dtype, seed=seed, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for weighted in (True, False):
            check_rms_norm((5, 16384), dtype, weighted, seed, device="cuda")  # mHC: 4 streams x 4096
            check_rms_norm((3, 64, 512), dtype, weighted, seed, device="cuda")  # q heads
            check_rms_norm((7, 1500), dtype, weighted, seed, device="cuda")
            check_rms_norm_rope((3, 64, 512), 64, dtype, weighted, seed, device="cuda")  # V4-Flash q heads
            check_rms_norm_rope((7, 512), 64, dtype, weighted, seed, device="cuda", strided=True)  # kv beside q_a


@pytest.mark.parametrize("n_keys", [1, 200, 640])
def test_decode_attention_kernel_compiled_equals_the_reference(n_keys):
    """V4-Flash widths: 64 heads of 512, window 128 + top-512 entries at most."""
    from tests.test_triton_kernels import check_decode_attention

    check_decode_attention(batch=4, heads=64, n_keys=n_keys, dim=512, dtype=torch.bfloat16, seed=n_keys, device="cuda")
    check_decode_attention(batch=2, heads=4, n_keys=n_keys, dim=32, dtype=torch.bfloat16, seed=n_keys, device="cuda")


def test_moe_pair_kernels_and_swiglu_compiled_equal_their_references():
    """V4-Flash widths: 32 tokens at top-6 over 4096 channels, shares of a split down GEMM; the shared
    expert's SwiGLU in bf16 (2048 wide) and float32."""
    from tests.test_triton_kernels import check_clamped_swiglu, check_moe_pairs, check_swiglu_pairs

    check_moe_pairs(tokens=32, k=6, dim=4096, shares=1, seed=7, device="cuda")
    check_moe_pairs(tokens=1, k=6, dim=4096, shares=2, seed=8, device="cuda")
    check_clamped_swiglu((32, 2048), torch.bfloat16, seed=9, device="cuda")
    check_swiglu_pairs(pairs=300, inter=2048, shares=2, seed=9, device="cuda")  # V4-Flash's inter
    check_clamped_swiglu((5, 3000), torch.float32, seed=10, device="cuda")


def test_decode_attention_in_place_compiled_equals_the_gathered_kernel():
    """V4-Flash widths (64 heads of 512, window 128) and a small head."""
    from tests.test_triton_kernels import check_decode_attention_in_place

    check_decode_attention_in_place(batch=4, heads=64, window=128, dim=512, dtype=torch.bfloat16, seed=5, device="cuda")
    check_decode_attention_in_place(batch=5, heads=4, window=40, dim=32, dtype=torch.bfloat16, seed=6, device="cuda")


@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_scores_kernel_compiled_equals_the_torch_path(seed):
    from tests.test_triton_kernels import check_masked_scores

    for dtype in (torch.bfloat16, torch.float16):
        check_masked_scores(n=300, heads=64, dim=128, total=1000, first=0, dtype=dtype, seed=seed, device="cuda")  # V4-Flash
        check_masked_scores(n=70, heads=64, dim=128, total=300, first=500, dtype=dtype, seed=seed, device="cuda")


def test_chunk_attention_kernel_compiled_equals_the_models_prefill_path():
    from tests.test_triton_kernels import check_chunk_attention

    check_chunk_attention(n=70, heads=64, span=128, dim=512, dtype=torch.bfloat16, seed=7, device="cuda")  # V4-Flash
    check_chunk_attention(n=9, heads=4, span=40, dim=32, dtype=torch.bfloat16, seed=8, device="cuda")


def test_rope_kernel_compiled_equals_the_reference():
    from tests.test_triton_kernels import check_rope

    for dtype in (torch.float32, torch.bfloat16):
        check_rope((3, 64, 512), 64, dtype, seed=0, device="cuda")  # q heads of V4-Flash
        check_rope((7, 512), 64, dtype, seed=1, device="cuda")  # kv, pooled entries
        check_rope((2, 64, 128), 64, dtype, seed=2, device="cuda")  # indexer heads


def test_rope_table_kernel_compiled_equals_the_reference():
    from tests.test_triton_kernels import check_rope_table

    check_rope_table(1, 32, 1, seed=0, device="cuda")  # a decode step's one position
    check_rope_table(4099, 32, 4, seed=1, device="cuda")  # a prefill chunk, CSA's rounding
    check_rope_table(33, 32, 128, seed=2, device="cuda")  # HCA's


@pytest.mark.parametrize("tokens", [1, 5])
def test_pairwise_experts_kernels_compiled_equal_the_reference(tokens):
    from tests.test_triton_kernels import check_experts_pairwise

    check_experts_pairwise(tokens, torch.bfloat16, seed=tokens, device="cuda", dim=4096, inter=2048)
    check_experts_pairwise(tokens, torch.float32, seed=tokens, device="cuda")


@pytest.mark.parametrize("store_dtype", [torch.bfloat16, torch.float32])
def test_indexer_scores_kernel_compiled_equals_the_reference(store_dtype):
    """V4-Flash's indexer: 64 heads of 128, 32 entries a page (block 128, rate 4), an 8K table."""
    from tests.test_triton_kernels import check_indexer_scores

    check_indexer_scores(batch=4, heads=64, dim=128, per_page=32, width=65, store_dtype=store_dtype, seed=3, device="cuda")


def test_packed_pages_on_graphs_equal_the_plain_cache(checkpoints):
    """V4.1 in bf16 with its simulated quantization, decode steps replaying graphs: packed FP4 pages,
    on the device or in the host tier (pinned host memory the gathers read in place, a ring of 16
    tokens per sequence, contexts to 81), give bitwise the logits of the plain cache (prompts
    prefilled eagerly on all three, in deterministic mode: the plain store's prefill would otherwise
    attend through the in-place chunk kernel, which packed pages do not take, and round differently)."""
    from bench.decode import pages_holding
    from kernels.batch_invariant import BatchInvariantMode
    from worker.cuda_graphs import DecodeRow

    model = load_model(checkpoints["v41"], dtype=torch.bfloat16, device="cuda")
    runners = [ModelRunner(model, 4, 256, device="cuda", cuda_graphs=True, kv_cache_dtype=kind, kv_hot_tokens=hot)
               for kind, hot in (("auto", None), ("fp4", None), ("fp4", 16))]
    assert runners[2].cache.hot.stores[0].host.codes.is_cuda  # the host tier, seen from the device
    positions = [7, 30, 61]
    for runner in runners:
        for slot, n in enumerate(positions):
            with BatchInvariantMode():
                runner.model(ForwardBatch.build([(slot, random_tokens(n, seed=slot), 0)]), runner.cache)
    for step in range(20):
        tokens = random_tokens(3, seed=80 + step)
        logits = []
        for runner in runners:
            rows = [DecodeRow(s, tokens[s], positions[s], pages_holding(runner, s, positions[s] + 1)) for s in range(3)]
            runner.cache.hold_hot([(row.pages, row.position + 1) for row in rows])
            logits.append(runner.graphs.run(rows).clone())
        assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2]), f"step {step}"
        positions = [p + 1 for p in positions]
    assert runners[2].cache.hot.filled_pages > 0


def test_tiered_pages_on_cuda_read_host_memory_bitwise():
    from kernels.host_memory import mapped_host_bytes
    from tests.test_host_tier import check_tiered_pages

    allocated = torch.cuda.memory_allocated()
    bytes_ = mapped_host_bytes(64 << 20, "cuda")
    memory = bytes_.device
    assert memory.is_cuda and torch.cuda.memory_allocated() == allocated  # no device memory behind it
    memory[5:7] = 3  # a kernel writes the host mapping in place
    torch.cuda.synchronize()
    assert bytes_.host[:8].tolist() == [0, 0, 0, 0, 0, 3, 3, 0]  # the CPU sees it in the same bytes
    bytes_.host[9] = 4
    assert int(memory[9]) == 4
    del bytes_, memory
    for _ in range(3):  # released mappings are unregistered: the addresses can be mapped (and copied from) again
        gc.collect()
        again = mapped_host_bytes(64 << 20, "cuda")
        plain = torch.randn(16 << 20)
        assert torch.equal(plain.cuda().cpu(), plain)
        del again
    check_tiered_pages("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_kernel_compiled_equals_the_reference(dtype):
    from tests.test_triton_kernels import check_fp8_linear

    check_fp8_linear(rows=5, n=1000, k=1100, dtype=dtype, seed=3, device="cuda")
    check_fp8_linear(rows=1, n=2048, k=4096, dtype=dtype, seed=4, device="cuda")  # a V4-Flash-sized decode row


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_pair_compiled_equals_the_references(block, dtype):
    from tests.test_triton_kernels import check_fp8_linear_pair

    check_fp8_linear_pair(rows=1, n1=1024, n2=512, k=4096, dtype=dtype, seed=block, device="cuda", block=block)  # q_a, kv
    check_fp8_linear_pair(rows=7, n1=2048, n2=2048, k=4096, dtype=dtype, seed=5, device="cuda", block=block)  # gate, up


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_grouped_linear_compiled_equals_the_reference(block):
    """o_a_proj's shape (8 groups of 1024 rows over 4096 columns each): the split-K kernel within its
    tolerance at decode sizes and replayed in a CUDA graph; above them the dispatch (one dequantization
    pass, then the grouped product) bitwise the reference."""
    from kernels.fp8_linear import fp8_grouped_linear, fp8_grouped_linear_reference
    from tests.test_triton_kernels import check_fp8_grouped_linear, random_fp8_weight

    for rows in (1, 7):
        check_fp8_grouped_linear(rows, 8, 1024, 4096, torch.bfloat16, seed=rows, device="cuda", block=block)
    generator = torch.Generator("cuda").manual_seed(block)
    weight, scale = random_fp8_weight(8 * 1024, 4096, block, generator, "cuda")
    x = torch.randn(4, 8 * 4096, generator=generator, device="cuda").bfloat16()
    eager = fp8_grouped_linear(x, weight, scale, 8, block)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_grouped_linear(x, weight, scale, 8, block)
    graph.replay()
    assert torch.equal(replayed, eager)
    wide = torch.randn(64, 8 * 4096, generator=generator, device="cuda").bfloat16()
    assert torch.equal(fp8_grouped_linear(wide, weight, scale, 8, block),
                       fp8_grouped_linear_reference(wide, weight, scale, 8, block))


def test_paired_outputs_feed_the_norm_and_swiglu_kernels_in_place():
    from tests.test_triton_kernels import check_clamped_swiglu, check_rms_norm

    check_rms_norm((5, 1024), torch.bfloat16, True, seed=1, device="cuda", strided=True)
    check_clamped_swiglu((5, 2048), torch.bfloat16, seed=2, device="cuda", side_by_side=True)


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_last_share_sums_compiled_are_the_sum_kernels_bits(block):
    """The split-K kernel whose last program of a tile adds the shares (arrival counters, acq_rel):
    bitwise the two-kernel path's result, eagerly and replayed in a CUDA graph many times over (a
    missed arrival or a stale read would show as a wrong tile), counters at zero after."""
    import kernels.fp8_linear as fp8
    from kernels.split_k import tile_counters
    from tests.test_triton_kernels import random_fp8_weight

    generator = torch.Generator("cuda").manual_seed(block)
    weight, scale = random_fp8_weight(4096, 4096, block, generator, "cuda")
    x = torch.randn(8, 4096, generator=generator, device="cuda").bfloat16()
    config = fp8.decode_config(block, 8)
    counted = fp8.fp8_linear_triton(x, weight, scale, block, config)
    two_kernels = fp8.fp8_linear_triton(x, weight, scale, block, config, last_sums=False)
    assert torch.equal(counted, two_kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8.fp8_linear_triton(x, weight, scale, block, config)
    for _ in range(50):
        graph.replay()
        assert torch.equal(replayed, two_kernels)
    assert not bool(tile_counters(x.device, 1).any())


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_tensor_core_tiles_compiled_equal_the_reference(block, dtype):
    """The large-M path (prefill, large decode batches) with its default tiles, on fresh random inputs,
    for V4's 128 x 128 and V4.1's 32 x 32 blocks; M, N and K off the tiles; a V4-Flash o_b-sized one."""
    from tests.test_triton_kernels import check_fp8_linear

    check_fp8_linear(rows=300, n=1000, k=1100, dtype=dtype, seed=7, device="cuda", block=block, path="tc")
    check_fp8_linear(rows=1024, n=4096, k=8192, dtype=dtype, seed=8, device="cuda", block=block, path="tc")


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_fp8_activations_compiled_equal_their_reference(block):
    from tests.test_triton_kernels import check_fp8_linear_w8a8

    check_fp8_linear_w8a8(rows=300, n=1000, k=1024, block=block, seed=9, device="cuda")
    check_fp8_linear_w8a8(rows=2048, n=2048, k=4096, block=block, seed=10, device="cuda")


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_large_m_dispatch_is_bitwise_the_reference(block):
    """Above TRITON_MAX_ROWS rows fp8_linear dequantizes W in one Triton pass and calls cuBLAS: the
    reference's result bit for bit (128 x 128 and 32 x 32 blocks, shapes off the blocks)."""
    from tests.test_triton_kernels import check_fp8_dequant

    check_fp8_dequant(n=1000, k=1100, block=block, seed=11, device="cuda", rows=300)
    check_fp8_dequant(n=4096, k=8192, block=block, seed=12, device="cuda", rows=2048)


def test_fp8_linear_scaled_mm_opt_in_equals_its_reference():
    """fp8_activations: torch's blockwise FP8 GEMM (x per 1 x 128 group) through fp8_linear, within
    float32 summation order of fp8_linear_w8a8_reference and e4m3's rounding of the bf16 reference."""
    import kernels.fp8_linear as fp8
    from kernels.quant import quantize_fp8_blocks

    generator = torch.Generator("cuda").manual_seed(13)
    for rows, n, k in ((300, 1024, 1024), (2049, 4096, 8192)):
        weight, scale = quantize_fp8_blocks(torch.randn(n, k, generator=generator, device="cuda"))
        x = (torch.randn(rows, k, generator=generator, device="cuda") * 3).bfloat16()
        got = fp8.fp8_linear(x, weight, scale, fp8_activations=True)
        assert got.shape == (rows, n) and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.float(), fp8.fp8_linear_w8a8_reference(x, weight, scale).float(),
                                   rtol=2e-2, atol=2e-2 * k**0.5)
        bf16 = fp8.fp8_linear_reference(x, weight, scale).float()
        assert float((got.float() - bf16).norm() / bf16.norm()) < 5e-2


def test_pairwise_mxfp4_experts_compiled_equal_the_reference():
    from tests.test_triton_kernels import check_experts_pairwise

    check_experts_pairwise(tokens=5, dtype=torch.bfloat16, seed=2, dim=256, inter=192, mxfp4=True, device="cuda")


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_mxfp4_tensor_core_experts_compiled_equal_the_reference(tokens):
    """kernels/moe_mxfp4.py compiled, with the decode and prefill block shapes it dispatches and small
    ones, at widths that are not multiples of the blocks and at V4-Flash's."""
    from kernels.moe_mxfp4 import DECODE_BLOCKS, LARGE_PREFILL_BLOCKS, PREFILL_BLOCKS
    from tests.test_triton_kernels import check_experts_mxfp4_tensor_cores

    for blocks in (None, DECODE_BLOCKS, PREFILL_BLOCKS, LARGE_PREFILL_BLOCKS):
        check_experts_mxfp4_tensor_cores(tokens, seed=tokens, device="cuda", dim=320, inter=224, blocks=blocks)
    check_experts_mxfp4_tensor_cores(tokens, seed=tokens, device="cuda", dim=4096, inter=2048, blocks=DECODE_BLOCKS)


if triton is not None:

    @triton.jit
    def _mxfp4_ptx_tile_kernel(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr):
        rows = tl.arange(0, N)[:, None]
        codes = tl.load(codes_ptr + rows * (K // 2) + tl.arange(0, K // 2)[None, :])
        scales = tl.load(scales_ptr + rows * (K // 32) + tl.arange(0, K // 32)[None, :])
        even, odd = _mxfp4_as_bf16_ptx(codes, scales, N, K)
        tl.store(out_ptr + rows * K + tl.arange(0, K)[None, :], tl.join(even, odd).reshape(N, K))


def test_mxfp4_ptx_upcast_compiled_is_bitwise_the_reference():
    """kernels/moe_mxfp4.py's PTX decode of every code byte under E8M0 exponents from 0 (the subnormal
    2 ** -127) to 254 (6 x 2 ** 127 overflows to inf, as the reference's float32 does): the reference's
    bf16 bits, signed zeros included."""
    from kernels.quant import dequantize_mxfp4

    rows, cols = 16, 512
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)  # every byte in every row
    exponents = torch.tensor([0, 1, 2, 3, 100, 126, 127, 128, 129, 200, 253, 254], dtype=torch.uint8)
    scales = exponents[(torch.arange(rows)[:, None] + torch.arange(cols // 32)[None, :]) % len(exponents)]
    want = dequantize_mxfp4(codes, scales).to(torch.bfloat16)  # on the CPU: exact, subnormals kept
    got = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    _mxfp4_ptx_tile_kernel[(1,)](codes.cuda(), scales.cuda(), got, N=rows, K=cols)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_mxfp4_ptx_experts_compiled_equal_the_reference(tokens):
    """The PTX decode through both kernels, with the block shapes of the test above, K split into
    shares or not."""
    from kernels.moe_mxfp4 import DECODE_BLOCKS, LARGE_PREFILL_BLOCKS, PREFILL_BLOCKS
    from tests.test_triton_kernels import check_experts_mxfp4_tensor_cores

    for blocks in (None, DECODE_BLOCKS, PREFILL_BLOCKS):
        check_experts_mxfp4_tensor_cores(tokens, seed=tokens, device="cuda", dim=320, inter=224, blocks=blocks,
                                         upcasts=("ptx",), splits=(None, (2, 2)))
    for blocks in (PREFILL_BLOCKS, LARGE_PREFILL_BLOCKS):  # the sorted kernels on the layout prefill reads
        check_experts_mxfp4_tensor_cores(tokens, seed=tokens, device="cuda", dim=256, inter=128, blocks=blocks,
                                         upcasts=("ptx",), splits=(None,), mma_layout=True)
    check_experts_mxfp4_tensor_cores(tokens, seed=tokens, device="cuda", dim=4096, inter=2048, blocks=DECODE_BLOCKS,
                                     upcasts=("ptx",))


@pytest.mark.parametrize("mma_layout", [False, True])
def test_fp8_experts_compiled_equal_their_reference(mma_layout):
    """kernels/moe_mxfp4_fp8.py compiled with both upcasts and the tiles it dispatches, scale groups
    up to 12 binades under their step's top (so the e4m3 rounding below 8 binades is exercised)."""
    from kernels.moe_mxfp4_fp8 import FP8_BLOCKS
    from tests.test_moe_mxfp4_fp8 import SMALL_BLOCKS, check_experts_fp8

    for blocks in (SMALL_BLOCKS, FP8_BLOCKS):
        check_experts_fp8(tokens=70, seed=5, device="cuda", blocks=blocks, upcasts=("lut", "ptx"), mma_layout=mma_layout)


def test_fp8_experts_ptx_upcast_is_the_table_bitwise():
    """The PTX decode (f16 placement, a multiply, cvt.rn.satfinite) gives the table's e4m3 bits for every
    code at every shift, the shifts past the table's last row included (scale groups up to 20 binades
    under their step's top): the hidden rows and down's outputs are the same bits."""
    from kernels.mma_layout import from_released
    from kernels.moe_mxfp4 import Tile
    from kernels.moe_mxfp4_fp8 import FP8_BLOCKS, SortedPairs, fp8_down, fp8_hidden
    from tests.test_moe_mxfp4_fp8 import random_experts

    generator = torch.Generator("cuda").manual_seed(6)
    x = torch.randn(300, 512, generator=generator, device="cuda").bfloat16()
    experts = torch.randint(0, 4, (300, 6), generator=generator, device="cuda")
    weights = torch.rand(300, 6, generator=generator, device="cuda")
    gate_up, down = (from_released(w.codes, w.scales) for w in random_experts(generator, 512, 256, 20, "cuda"))
    tiles = [Tile(*FP8_BLOCKS[g]) for g in ("gate_up", "down")]
    pairs = SortedPairs.build(experts, weights, 0, 4, tiles[0].block_m)
    hidden = {u: fp8_hidden(x, pairs, gate_up, 7.0, False, tiles[0], u) for u in ("lut", "ptx")}
    assert torch.equal(hidden["lut"], hidden["ptx"])
    assert torch.equal(fp8_down(hidden["lut"], pairs, down, tiles[1], "lut"), fp8_down(hidden["lut"], pairs, down, tiles[1], "ptx"))


def test_fp8_prefill_moe_layer_rounds_only_its_activations():
    """A released V4-Flash-dims MoE layer (MXFP4 experts in the CUDA kernel's layout, FP8 shared expert) on
    a 512-token chunk (3,072 pairs: the sorted kernels) with `prefill_in_fp8` against the same layer
    without: the e4m3 path is taken (the outputs differ) and computes the same function (within e4m3's
    rounding of the activations); a decode-sized step is untouched (bitwise)."""
    from bench.slice import FLASH_CONFIG, slice_config
    from models import ModelConfig
    from models.layers import prefill_in_fp8
    from models.moe import lay_out_experts_for_mma
    from models.random_model import build_random_model, quantize_as_released

    model = build_random_model(ModelConfig.from_dict(slice_config(FLASH_CONFIG, 1)), torch.bfloat16, "cuda", 0)
    quantize_as_released(model)
    assert lay_out_experts_for_mma(model) == 1
    moe = model.model.layers[0].mlp
    generator = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(512, model.config.hidden_size, generator=generator, device="cuda").bfloat16()
    ids = torch.randint(0, model.config.vocab_size, (512,), generator=generator, device="cuda")
    with torch.no_grad():
        exact, exact_step = moe(x, ids).float(), moe(x[:4], ids[:4])
        assert prefill_in_fp8(model) > 1
        rounded, rounded_step = moe(x, ids).float(), moe(x[:4], ids[:4])
    assert not torch.equal(rounded, exact)
    assert float((rounded - exact).norm() / exact.norm()) < 0.05
    assert torch.equal(rounded_step, exact_step)
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kernel", ["triton", "mma"])
def test_mxfp4_decode_experts_replay_in_a_cuda_graph(kernel):
    """The decode kernels never sync: a captured step replays to the eager result on new routing and
    activations (`mma`: the CuPy-launched CUDA kernel runs on torch's stream)."""
    from kernels.mma_layout import from_released
    from kernels.moe_mxfp4 import experts_by_expert
    from kernels.quant import MXFP4Experts, quantize_mxfp4

    if kernel == "mma":
        pytest.importorskip("cupy")
        from kernels.moe_mxfp4_mma import experts_mma as run_experts

        held = from_released
    else:
        run_experts, held = experts_by_expert, MXFP4Experts
    generator = torch.Generator("cuda").manual_seed(5)
    gate_up = held(*quantize_mxfp4(torch.randn(8, 256, 256, device="cuda", generator=generator) / 16))
    down = held(*quantize_mxfp4(torch.randn(8, 256, 128, device="cuda", generator=generator) / 11))
    x = torch.randn(4, 256, device="cuda", generator=generator).bfloat16()
    experts = torch.randint(0, 8, (4, 6), device="cuda", generator=generator)
    weights = torch.rand(4, 6, device="cuda", generator=generator)
    run = lambda: run_experts(x, weights, experts, gate_up, down, 0, 7.0, False)  # noqa: E731 - reads at replay time
    run()  # compiled (and loaded) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    experts.copy_(torch.randint(0, 8, (4, 6), device="cuda", generator=generator))
    x.copy_(torch.randn(4, 256, device="cuda", generator=generator))
    graph.replay()
    assert torch.equal(captured, run())


@pytest.mark.parametrize("tokens", [1, 7, 40, 340])
def test_mxfp4_mma_experts_compiled_equal_the_reference(tokens):
    """kernels/moe_mxfp4_mma.py (CUDA C++ through CuPy's NVRTC): this rank holds experts [2, 6) of 8,
    ~15 pairs an expert at 40 tokens (a block of 16 and a second block), 1,020 pairs at 340 (up to
    MAX_SCAN_PAIRS), K whole or in shares, routing weights before or after down; weights whose scales
    all fit the one-multiply decode and weights 2 ** 12 larger, whose do not; the tolerance is the
    reference's bf16 rounding of gate / up. (Past MAX_SCAN_PAIRS the sorted Triton kernels take this
    layout: tests/test_triton_kernels.py.)"""
    pytest.importorskip("cupy")
    from kernels.moe import experts_reference
    from kernels.mma_layout import from_released
    from kernels.moe_mxfp4_mma import experts_mma
    from kernels.quant import MXFP4Experts, quantize_mxfp4

    generator = torch.Generator("cuda").manual_seed(tokens)
    for dim, inter, gain in ((256, 128, 1.0), (4096, 2048, 1.0), (256, 128, 2.0**12)):
        gate_up = MXFP4Experts(*quantize_mxfp4(torch.randn(4, 2 * inter, dim, generator=generator, device="cuda") * gain / dim**0.5))
        down = MXFP4Experts(*quantize_mxfp4(torch.randn(4, dim, inter, generator=generator, device="cuda") / inter**0.5))
        tiled = from_released(gate_up.codes, gate_up.scales), from_released(down.codes, down.scales)
        assert tiled[0].small_scales == (gain == 1.0) and tiled[1].small_scales
        x = torch.randn(tokens, dim, generator=generator, device="cuda").bfloat16()
        experts = torch.randint(0, 8, (tokens, 3), generator=generator, device="cuda")
        weights = torch.rand(tokens, 3, generator=generator, device="cuda")
        for before_down in (False, True):
            want = experts_reference(x, weights, experts, gate_up, down, 2, 1.5, before_down)
            for shares in (None, (1, 1), (3, 2)):
                got = experts_mma(x, weights, experts, *tiled, 2, 1.5, before_down, shares=shares)
                torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_mxfp4_gate_up_last_share_sums_are_the_sum_kernels_bits():
    """V4-Flash-sized decode steps of 1 and 2 tokens (gate_up split into 2 and 4 K shares): the last
    share's sums (kernels/split_k.py) give the separate sum kernel's bits, eagerly and over 50 graph
    replays on changing routing; the counters are back at zero after."""
    from kernels.moe_mxfp4 import experts_by_expert
    from kernels.split_k import tile_counters
    from kernels.quant import MXFP4Experts, quantize_mxfp4

    generator = torch.Generator("cuda").manual_seed(6)
    gate_up = MXFP4Experts(*quantize_mxfp4(torch.randn(16, 4096, 4096, device="cuda", generator=generator) / 64))
    down = MXFP4Experts(*quantize_mxfp4(torch.randn(16, 4096, 2048, device="cuda", generator=generator) / 45))
    for tokens in (1, 2):
        x = torch.randn(tokens, 4096, device="cuda", generator=generator).bfloat16()
        experts = torch.randint(0, 16, (tokens, 6), device="cuda", generator=generator)
        weights = torch.rand(tokens, 6, device="cuda", generator=generator)
        run = lambda last_sums=True: experts_by_expert(x, weights, experts, gate_up, down, 0, 10.0, False,  # noqa: E731
                                                       last_sums=last_sums)
        assert torch.equal(run(), run(last_sums=False))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        for _ in range(50):
            experts.copy_(torch.randint(0, 16, (tokens, 6), device="cuda", generator=generator))
            graph.replay()
            assert torch.equal(captured, run(last_sums=False))
    assert not bool(tile_counters(x.device, 1).any())


def test_verify_batch_on_the_decode_path_is_the_chunk_of_its_tokens():
    """Issue 27's verify step as a decode batch of waves (tests/test_verify_decode.py) through the GPU
    kernels: the Triton pooler and indexer updates run wave by wave, the in-place attention reads
    repeated slots masked by position."""
    from tests.test_verify_decode import check_verify_batch

    check_verify_batch("cuda", dict(rtol=2e-3, atol=2e-3))


def test_v41_verify_batch_on_the_decode_path_is_the_chunk_of_its_tokens(checkpoints):
    """The same for V4.1 (tests/test_verify_decode.py): the group-pool kernel runs wave by wave (its
    programs would race on a slot's ring rows otherwise), the Engram rows hashed on the device wave by
    wave by the hashing kernel."""
    from models import load_model
    from tests.test_verify_decode import check_verify_batch_v41

    model = load_model(checkpoints["v41"], device="cuda", simulate_quantization=False)
    check_verify_batch_v41(model, "cuda", dict(rtol=2e-3, atol=2e-3))


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_verify_graphs_emit_plain_greedys_tokens(method):
    """A graphed runner with draft rows verifies on its verify graphs (1 + 3 rows a sequence, wave-major;
    the MTP proposer reads the streams the graphs keep): greedy fed its proposed drafts emits the tokens
    plain graphed greedy emits, with a chunked prompt (tests/test_proposers.py's loop), and the verify
    graphs were replayed. Plain greedy's tokens up to where bf16 roundings may flip a near tie."""
    from models.random_model import build_random_model
    from tests.test_proposers import CONFIG

    check_verify_graphs(build_random_model(CONFIG, torch.bfloat16, "cuda", seed=2, mtp=True), method)


def test_v41_verify_graphs_emit_plain_greedys_tokens(checkpoints):
    """The same for V4.1 with prompt lookup: its verify graphs fetch each wave's Engram rows (hashed wave
    by wave on the device) and roll the look-backs of rejected drafts back."""
    from models import load_model

    model = load_model(checkpoints["v41"], dtype=torch.bfloat16, device="cuda", simulate_quantization=False)
    check_verify_graphs(model, "ngram")


def test_dspark_runner_replays_graphs_that_keep_its_taps(tmp_path):
    """A V4.1 runner drafting with DSpark captures decode and verify graphs that keep the draft's taps
    (it ran eagerly before): greedy fed the drafts emits plain graphed greedy's tokens."""
    from models import load_model
    from models.dspark import attach_dspark, build_tiny_dspark
    from models.tiny import build_tiny_checkpoint

    target = build_tiny_checkpoint(tmp_path / "v41", seed=3)
    draft = build_tiny_dspark(tmp_path / "draft", target, seed=4, dspark_markov_rank=128)
    model = load_model(target, dtype=torch.bfloat16, device="cuda", simulate_quantization=False)
    attach_dspark(model, draft)
    check_verify_graphs(model, "dspark")  # confidence threshold 0: every block proposes K drafts


def check_verify_graphs(model, method: str) -> None:
    from tests.test_proposers import K, decode
    from worker.proposers import build_proposer

    plain = ModelRunner(model, num_slots=2, max_model_len=128, device="cuda", cuda_graphs=True)
    want, _ = decode(plain, 24)
    proposer = build_proposer(method, model, num_slots=2, max_model_len=128, k=K)
    runner = ModelRunner(model, num_slots=2, max_model_len=128, device="cuda", cuda_graphs=True, draft_tokens=K,
                         proposer=proposer)
    assert runner.graphs is not None and runner.graphs.waves == list(range(1, K + 2))
    assert {waves for _, _, waves in runner.graphs.graphs} == set(range(1, K + 2))  # batch x K buckets
    assert (runner.graphs.taps is not None) == bool(proposer.tap_layers)
    replays = runner.graphs.replays
    sent = []
    got, accepted = decode(runner, 24, lambda out, drafts: sent.append(len(drafts)))
    assert sum(sent) >= K  # some steps verified drafts
    # bf16 rows batched differently round differently, so the two may part at a near tie (top-2 gap
    # within ~2 bf16 ulps of these logits, 1/64 each) and only there; until then the same tokens with
    # logprobs within those roundings
    gaps = [t.top[0][1] - t.top[1][1] for t in want]
    agreed = next((i for i, (a, b) in enumerate(zip(got, want)) if a.token_id != b.token_id), len(want))
    assert agreed == len(want) or gaps[agreed] < 0.04, (agreed, [round(g, 3) for g in gaps])
    for a, b in zip(got[:agreed], want[:agreed]):
        assert abs(a.logprob - b.logprob) < 0.04, (a, b)
    assert runner.graphs.replays - replays == len(accepted)  # every decode and verify step replayed a graph
    # after that warm-up the same run again (its prompt, decodes, verifies, drafts) allocates no device memory
    before = torch.cuda.memory_stats()
    decode(runner, 24)
    after = torch.cuda.memory_stats()
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]


def test_engram_gather_kernel_compiled_is_bitwise_the_reference():
    from tests.test_triton_kernels import check_engram_gather

    check_engram_gather(rows=4000, dim=256, ids=64, seed=1, device="cuda")  # V4.1-Flash's 256-wide rows


def test_slot_lookup_kernel_compiled_is_bitwise_the_reference():
    from tests.test_triton_kernels import check_slot_lookup

    check_slot_lookup(capacity=20000, rows=4999, seed=1, device="cuda")


def test_engram_hash_kernel_compiled_is_bitwise_the_reference():
    from tests.test_triton_kernels import check_engram_hash

    check_engram_hash(batch=300, seed=1, device="cuda")


def test_count_hits_kernel_compiled_equals_the_reference():
    from tests.test_triton_kernels import check_count_hits

    check_count_hits(capacity=30000, slots=9000, seed=1, device="cuda")


def test_unpack_fp4_kernel_compiled_is_bitwise_the_reference():
    from tests.test_triton_kernels import check_unpack_fp4

    check_unpack_fp4(rows=64, dim=512, seed=1, device="cuda")  # V4.1-Flash entries
    check_unpack_fp4(rows=33, dim=128, seed=2, device="cuda")  # index keys


@pytest.mark.parametrize("name,kv_cache_dtype,kv_hot_tokens", [("mixed", "auto", None), ("v41", "fp4", 16)])
def test_prefix_tiers_round_trip_on_cuda_is_bitwise(checkpoints, tmp_path, name, kv_cache_dtype, kv_hot_tokens):
    """Spill -> write -> fetch -> load of a state point on the device: the spills and loads are indexed
    copy kernels through the mapped pinned host rows (with the KV host tier, between two host mappings),
    and the disk writer and reader wait on the CUDA events recorded after the plan's spills; the loaded
    slot decodes bitwise like the original."""
    from tests.test_prefix_tiers_worker import check_round_trip

    model = load_model(checkpoints[name], device="cuda")
    check_round_trip(model, tmp_path, kv_cache_dtype, kv_hot_tokens, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_kernel_compiled_is_bitwise_the_torch_ops(dtype):
    """V4.1's simulated FP8 / FP4 roundings as the models call them on CUDA (one kernel each) against the
    torch ops on the CPU, bit for bit: tests/test_fake_quant.py's inputs (ties, subnormals, zeros, ~40
    binades) and a V4.1-Flash window row's width."""
    from kernels.fake_quant import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0, fake_quant_fp8_ue8m0
    from tests.test_fake_quant import _bits, quantizer_inputs

    for seed in range(3):
        x = quantizer_inputs(dtype, seed)
        wide = (torch.randn(7, 512, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
        for quantize, block in ((fake_quant_fp8_ue8m0, 32), (fake_quant_fp4_ue8m0, 32), (fake_quant_fp4_e4m3, 16)):
            for t in (x, wide):
                assert torch.equal(_bits(quantize(t.cuda(), block).cpu()), _bits(quantize(t, block)))


def test_group_pool_kernel_compiled_equals_the_reference():
    from tests.test_triton_kernels import check_group_pool

    check_group_pool(batch=33, dim=512, rate=4, ring=4, seed=0, device="cuda")  # V4.1-Flash's CSA2 width
    check_group_pool(batch=3, dim=512, rate=128, ring=131, seed=1, device="cuda")  # a long group, draft rows


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_mtp_draft_graphs_replay_their_eager_steps(family, tmp_path):
    """The MTP proposer's draft graphs (worker/mtp_graphs.py), captured, against the same steps run eagerly
    on the GPU (tests/test_mtp_draft_steps.py's script: every count of standing rows, prompt chunks beside
    decode chunks, a padded bucket; V4.1's pre mixes beside the streams): the same drafts and bitwise the
    same layer state."""
    from models import load_model
    from models.random_model import build_random_model
    from models.tiny import build_tiny_checkpoint
    from tests.test_mtp_draft_steps import SLOTS, steps_script
    from tests.test_proposers import CONFIG, K
    from worker.proposers import MTPProposer

    if family == "v4":
        model = build_random_model(CONFIG, torch.bfloat16, "cuda", seed=2, mtp=True)
    else:
        checkpoint = build_tiny_checkpoint(tmp_path / "v41", seed=6, family="v41", num_nextn_predict_layers=1)
        model = load_model(checkpoint, dtype=torch.bfloat16, device="cuda", mtp=True)
    eager = MTPProposer(model, num_slots=SLOTS, max_model_len=128, k=K)
    eager.use_static_steps()
    graphed = MTPProposer(model, num_slots=SLOTS, max_model_len=128, k=K)
    assert graphed.capture_graphs() > 0 and graphed.steps is not None and graphed.steps.graphs
    script, _ = steps_script(seed=0, like=model.lm_head.weight, config=model.config)
    for step, chunks in enumerate(script):
        assert graphed.propose(chunks) == eager.propose(chunks), f"step {step}"
    assert graphed.steps.runs == eager.steps.runs and len(graphed.steps.runs) >= 10
    # the request slots (the scratch slot's rows are written by several scratch rows at once, in any order)
    assert all(torch.equal(a[:SLOTS], b[:SLOTS]) for a, b in zip(graphed.cache.tensors(), eager.cache.tensors()))


def test_dspark_draft_graphs_replay_their_eager_steps(tmp_path):
    """The DSpark proposer's draft graphs (worker/dspark_graphs.py), captured, against the same steps run
    eagerly on the GPU (tests/test_mtp_draft_steps.py's script with taps): the same drafts and confidence
    cuts, bitwise the same rings."""
    from models import load_model
    from models.dspark import attach_dspark, build_tiny_dspark
    from models.tiny import build_tiny_checkpoint
    from tests.test_mtp_draft_steps import SLOTS, steps_script
    from tests.test_proposers import K
    from worker.dspark import DSparkProposer

    target = build_tiny_checkpoint(tmp_path / "v41", seed=3)
    model = load_model(target, dtype=torch.bfloat16, device="cuda")
    attach_dspark(model, build_tiny_dspark(tmp_path / "draft", target, seed=4, dspark_markov_rank=128))
    eager = DSparkProposer(model, num_slots=SLOTS, k=K, confidence_threshold=0.5)
    eager.use_static_steps()
    graphed = DSparkProposer(model, num_slots=SLOTS, k=K, confidence_threshold=0.5)
    assert graphed.capture_graphs() > 0 and graphed.steps is not None and graphed.steps.graphs
    script, _ = steps_script(seed=1, like=model.lm_head.weight, config=model.config, taps=len(eager.tap_layers))
    for step, chunks in enumerate(script):
        assert graphed.propose(chunks) == eager.propose(chunks), f"step {step}"
    assert graphed.steps.runs == eager.steps.runs and len(graphed.steps.runs) >= 10
    assert torch.equal(graphed.rings[:, :SLOTS], eager.rings[:, :SLOTS])  # the request slots (see the MTP test)
