"""Decode, TTFT and a transformers comparison on an N-layer slice of a real config with random weights,
built in device memory (no checkpoint), each figure beside the ceiling it is judged by (JSON lines).

    python -m bench.slice decode [--concurrency 1 8 32] [--context 0 8192] [--steps 32]
                                 [--modes default deterministic] [--row-budget-s 30]
    python -m bench.slice ttft [--prompt 1024 8192 32768] [--prefill-chunk 2048 | --prefill-chunks 2048 4096 ...] [--repeats 2]
    python -m bench.slice transformers [--concurrency 1 8 32] [--prompt-len 512] [--steps 32]
    python -m bench.slice profile [--concurrency 1 32] [--steps 8] [--top 40] [--enforce-eager]
    python -m bench.slice families [--concurrency 1 8 32] [--steps 32] [--repeats 20]
    python -m bench.slice verify [--concurrency 1 8 32] [--draft-tokens 1 2 3 4 5 6 7] [--steps 32]
    common: [--config configs/models/DeepSeek-V4-Flash/config.json] [--layers 4] [--device cuda|cpu]
            [--dtype bfloat16] [--weights bf16|released] [--prefill-activations model|fp8] [--seed 0]
            [--copy-mib 4096] [--gemm-n 8192]

`--weights released` puts the slice in the release's formats before the run (MXFP4 routed experts,
FP8 attention projections and shared expert: models/random_model.quantize_as_released), as
`model.quantization: checkpoint` serves them; bytes read per step and the roofline count them so.
`--prefill-activations fp8` (with released weights) prefills as `model.prefill_activations: fp8` does
(e4m3 activations for the MXFP4 experts and the FP8 linears).

Every command first prints its `slice.model` line (parameter bytes; bytes and parameters a token
activates: attention, shared expert, top-k experts, embedding row, head), then `slice.copy` (device-to-
device copy bandwidth, read + written) and `slice.matmul` (bf16 GEMM ceiling), measured in this run.

- decode: one line per (mode, concurrency, context): step p50 / p90 ms, tokens/s, bytes read per step
  (weights touched, from the experts one untimed step routed to, + KV attended), roofline tokens/s =
  copy bandwidth / bytes per step x concurrency, and the ratio to it. Decode steps feed seeded random
  tokens (a random model's greedy output repeats one token and routes every row alike). The context is
  prefilled once into slot 0, through the model in the default mode, and copied to the other slots. A
  row stops after --steps timed steps or --row-budget-s seconds (at least 3 steps), whichever is first.
  Mode `default` times each step alone (launch to landing, synchronized); `overlapped` launches each
  step before the one before it lands, as the engine's async scheduling does, and times landing to
  landing: the host's planning and input copies then hide behind the device's previous step.
- ttft: one sequence, prefilled in --prefill-chunk chunks (or each size of --prefill-chunks in turn)
  through ModelRunner (as the engine's chunked prefill does); TTFT, prefill tokens/s, useful FLOP/s and
  its ratio to the matmul ceiling, and the peak device memory the prefill held beyond what was
  allocated before it (`peak_workspace_bytes`, CUDA only: the memory a chunk size needs).
- families: per kernel family of a decode step at context 0 (attention projections, mHC, router,
  shared expert, routed experts, head: bench/slice_families.py), its device time alone in a CUDA
  graph, the weight bytes it reads, bytes/s and the ratio to the copy bandwidth of this run, beside the
  measured step (CUDA graphs, as decode's default mode) and what the families leave of it (`rest`).
- verify: the cost of a speculative decoding verify step (issue 27): per concurrency, the plain decode
  step (CUDA graphs, as decode's default mode), then for each K of --draft-tokens a step whose
  sequences each forward their last token and K drafts and draw at every position (the runner's
  verification; on CUDA the verify graphs of a runner built for that K, 1 + K rows a sequence), from
  context 0; the random model's drafts would be rejected, so acceptance is forced: positions advance
  by K + 1. Step p50 / p90 and `cost_ratio`, verify step over plain step.
- transformers: HF `DeepseekV4ForCausalLM.generate` over the SAME tensors (bench/slice_hf.py), and our
  runner on the same prompts, per batch size; HF's decode tokens/s = (B x (steps - 1)) / (t(steps) -
  t(1 token)). Needs transformers >= 5.24 (the GPU image has 5.17: carry the wheel in .whl/).

On the lent H200 (device README; V4-Flash dims, 4 layers: 27.4B parameters, 54.8 GB in bf16, batch-1
step 3.4 GB), two calls, each under 9 minutes (run with timeout_s 590). Call 1 (`.whl` carried; est. 4-7 min):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv; git rev-parse --short HEAD; timeout 300 python3 -m bench.slice decode --modes default deterministic --row-budget-s 15 --steps 32 2>&1 | tee $OUT/decode.jsonl; timeout 200 python3 -m bench.slice ttft 2>&1 | tee $OUT/ttft.jsonl

Call 2 (`.whl` carried; est. 2-4 min):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; timeout 420 python3 -m bench.slice transformers 2>&1 | tee $OUT/transformers.jsonl

Estimates, from the byte and FLOP counts (not measured yet): each process spends ~20-40 s on imports,
CUDA start, the 55 GB random draw (~1 s of device time) and the ceilings (4 GiB copy x 12, 8192^3 GEMM
x 13: < 1 s). The roofline step is 0.8 ms at batch 1 (3.39 GB / 4.28 TB/s: 1,262 tokens/s) and ~7 ms
at batch 32 (~136 of 256 experts touched per layer: 29.6 GB; KV at 8K adds 1.6 MB a sequence); today's
per-expert, per-chunk torch path is launch-bound at tens to hundreds of ms a step, so decode default
<= 6 rows x 33 steps x 0.3 s ~ 1 min plus two 8K prefills (4 chunks of 2048); deterministic rows are
capped by --row-budget-s 15 (at least 3 steps: ~2 min unless one step passes 5 s; `timeout 300` bounds
the command, and the lines printed so far are in $OUT). TTFT: 2.5 / 20.3 / 83.3 TFLOP useful for 1K /
8K / 32K (0.1 s at the ceiling for 32K); twice each plus a 1K warm-up, the torch path's masked dense
attention (scores [64, 2048, <= 10.4K] per chunk and layer) makes it tens of seconds to ~2 min.
transformers: HF measured 43.7 / 322 / 861 tokens/s at batch 1 / 8 / 32 (issue 8), so 3 x (33 generated
tokens plus a 512 x B prompt, twice) ~ 10-30 s, and ours on the same batches <= 3 x 30 s.
Memory: weights 54.8 GB; transformers shares them (no copy); the largest temporaries are the 32K
prefill's per-chunk scores (~3 GB a tensor in bf16, a few alive at once), far inside 139 GiB.
The commit field is empty where the copy of the tree carries no .git: note the commit by hand.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.decode import chunk, pages_holding
from bench.slice_families import capture_families, family_rows
from bench.slice_roofline import (
    active_params_per_token,
    copy_bandwidth,
    kv_bytes_read,
    matmul_ceiling,
    prefill_flops,
    weight_bytes_read,
)
from contract import StepPlan
from engine.memory_plan import model_bytes
from models import ForwardBatch, ModelConfig
from models.layers import prefill_in_fp8
from models.random_model import build_random_model, quantize_as_released
from worker import ModelRunner

FLASH_CONFIG = Path(__file__).resolve().parent.parent / "configs/models/DeepSeek-V4-Flash/config.json"
PER_LAYER_KEYS = ("compress_ratios", "layer_types", "mlp_layer_types")


def slice_config(path: Path, layers: int) -> dict[str, Any]:
    """config.json with its first `layers` layers (their attention kinds, compress ratios and MoE kinds
    kept), no MTP layer, and no quantization: the slice is built in the serving dtype."""
    raw = json.loads(path.read_text())
    if layers > raw["num_hidden_layers"]:
        raise SystemExit(f"{path} has {raw['num_hidden_layers']} layers; --layers {layers} asks for more")
    raw.update(num_hidden_layers=layers, num_nextn_predict_layers=0)
    for key in PER_LAYER_KEYS:
        if raw.get(key) is not None:
            raw[key] = raw[key][:layers]
    for key in ("quantization_config", "expert_dtype"):
        raw.pop(key, None)
    return raw


def build_slice(args: argparse.Namespace) -> tuple[dict[str, Any], torch.nn.Module]:
    raw = slice_config(Path(args.config), args.layers)
    config = ModelConfig.from_dict(raw)
    if config.is_v41:
        raise SystemExit("bench.slice counts V4 layer kinds (sliding / CSA / HCA) only: pass a deepseek_v4 config")
    model = build_random_model(config, getattr(torch, args.dtype), args.device, args.seed)
    if args.weights == "released":
        quantize_as_released(model)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.prefill_activations == "fp8":
        if args.weights != "released":
            raise SystemExit("--prefill-activations fp8 feeds the released formats' kernels: add --weights released")
        prefill_in_fp8(model)
    return raw, model


def run_fields(args: argparse.Namespace) -> dict[str, Any]:
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    fields = {"device": machine, "commit": commit, "dtype": args.dtype, "config": str(args.config), "layers": args.layers}
    if hasattr(args, "weights"):  # bench.long_context shares these fields and has no --weights
        fields["weights"] = args.weights
        fields["prefill_activations"] = args.prefill_activations
    return fields


def emit(row: dict[str, Any], fields: dict[str, Any]) -> None:
    print(json.dumps({**row, **fields}), flush=True)


def ceilings(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> tuple[float, float]:
    """Prints the model, copy and matmul lines; returns (copy bytes/s, matmul FLOP/s)."""
    config = model.config
    emit({
        "bench": "slice.model", "params": sum(t.numel() for t in model.parameters()), "param_bytes": model_bytes(model),
        "active_bytes_per_token": weight_bytes_read(model, [config.num_experts_per_tok] * config.num_layers, 1),
        "active_params_per_token": active_params_per_token(model),
        "layer_types": list(config.layer_types), "mlp_layer_types": list(config.mlp_layer_types),
    }, fields)
    copy = copy_bandwidth(args.device, args.copy_mib * 2**20)
    emit(copy, fields)
    gemm = matmul_ceiling(args.device, args.gemm_n, getattr(torch, args.dtype))
    emit(gemm, fields)
    return copy["bytes_per_s"], gemm["flops_per_s"]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextmanager
def routed_experts(model: torch.nn.Module) -> Iterator[list[int]]:
    """Distinct routed experts per layer over the forwards run inside (hooks on the routers; each
    hook syncs, so only untimed steps run inside)."""
    counts = [0] * model.config.num_layers

    def hook(layer: int):
        return lambda module, inputs, output: counts.__setitem__(layer, int(output[1].unique().numel()))

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def prefill_slot(runner: ModelRunner, slot: int, tokens: list[int], chunk_tokens: int) -> None:
    """Fills a slot's state with `tokens` from position 0, through the model in the default mode
    (set-up for decode, not timed)."""
    for start in range(0, len(tokens), chunk_tokens):
        runner.model(ForwardBatch.build([(slot, tokens[start : start + chunk_tokens], start)]), runner.cache)


def copy_slot_to_all(runner: ModelRunner, slots: int) -> None:
    """Slot 0's state (fixed and paged) copied into slots 1 .. slots - 1."""
    targets = list(range(1, slots))
    pages = runner.cache.default_pages
    runner.cache.copy_slots([0] * len(targets), targets)
    runner.cache.copy_pages(pages(0).tolist() * len(targets), [p for s in targets for p in pages(s).tolist()])


def random_tokens(generator: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def decode_steps(
    runner: ModelRunner, positions: list[int], concurrency: int, steps: int, budget_s: float, generator: torch.Generator,
    overlapped: bool = False,
) -> dict[str, Any]:
    """One untimed eager step (warm-up and expert probe) and, with graphs, one untimed replay, then timed
    steps of slots 0 .. concurrency - 1 fed
    random tokens; `positions` (per slot) advance. Returns timings, experts touched, mean context.
    `overlapped`: each step is launched before the one before it lands (`overlapped_steps`)."""
    vocab = runner.model.config.vocab_size

    def plan() -> StepPlan:
        tokens = random_tokens(generator, vocab, concurrency)
        planned = StepPlan(tuple(chunk(runner, s, [tokens[s]], positions[s]) for s in range(concurrency)))
        for s in range(concurrency):
            positions[s] += 1
        return planned

    graphs, runner.graphs = runner.graphs, None  # the probe runs eagerly: graph replays fire no hooks
    with routed_experts(runner.model) as touched:
        runner.execute(plan())
    runner.graphs = graphs
    if graphs is not None:  # an untimed replay: a bucket's first replay can cost a hundred steps (tiny V4.1)
        runner.execute(plan())
    first = positions[:concurrency]
    if overlapped:
        durations = overlapped_steps(runner, plan, steps, budget_s)
    else:
        durations = timed_steps(lambda: runner.execute(plan()), steps, budget_s, runner.device)
    return {
        "steps": len(durations), "step_ms_p50": 1000 * statistics.median(durations),
        "step_ms_p90": 1000 * _p90(durations),
        "tokens_per_s": concurrency * len(durations) / sum(durations), "experts_touched": touched,
        "contexts": [p + len(durations) // 2 for p in first],
    }


def timed_steps(step: Callable[[], None], steps: int, budget_s: float, device: str) -> list[float]:
    """Seconds of each `step()` (synchronized), until `steps` of them or `budget_s` (at least 3)."""
    durations: list[float] = []
    began = time.perf_counter()
    while len(durations) < steps and (len(durations) < 3 or time.perf_counter() - began < budget_s):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        durations.append(time.perf_counter() - start)
    return durations


def overlapped_steps(runner: ModelRunner, plan: Callable[[], StepPlan], steps: int, budget_s: float) -> list[float]:
    """Seconds between the landings of consecutive steps when each step is launched before the one
    before it lands, as the engine's overlapped scheduling runs them (`scheduler.async_scheduling`):
    the host plans and launches step N + 1 while the device runs step N, so a step costs the larger of
    its device time and its host time instead of their sum. The inputs are the plan's host tokens
    (random, as in the serial rows, so both route alike), not the device-side PENDING_TOKEN feed."""
    launched = runner.launch(plan())
    launched.result()  # a first landing, so the timed ones start from a step in flight
    durations: list[float] = []
    launched = runner.launch(plan())
    landed = began = time.perf_counter()
    while len(durations) < steps and (len(durations) < 3 or time.perf_counter() - began < budget_s):
        following = runner.launch(plan())
        launched.result()
        now = time.perf_counter()
        durations.append(now - landed)
        landed, launched = now, following
    launched.result()
    return durations


def _p90(durations: list[float]) -> float:
    return statistics.quantiles(durations, n=10)[-1] if len(durations) > 1 else durations[0]


def roofline(runner: ModelRunner, measured: dict[str, Any], concurrency: int, copy_bps: float) -> dict[str, Any]:
    """Bytes per step (weights touched + KV read) and the tokens/s reading them at copy bandwidth gives."""
    elem = runner.cache.layers[0].window.element_size()
    weights = weight_bytes_read(runner.model, measured.pop("experts_touched"), concurrency)
    kv = kv_bytes_read(runner.model.config, measured.pop("contexts"), elem)
    limit = concurrency * copy_bps / (weights + kv)
    return {**measured, "weight_bytes_per_step": weights, "kv_bytes_per_step": kv, "bytes_per_step": weights + kv,
            "roofline_tokens_per_s": limit, "ratio_to_roofline": measured["tokens_per_s"] / limit}


def cmd_decode(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> None:
    copy_bps, _ = ceilings(args, model, fields)
    most = max(args.concurrency)
    max_len = max(args.context) + len(args.concurrency) * (args.steps + 4) + 1  # 2 untimed, overlapped rows plan 2 more
    generator = torch.Generator().manual_seed(args.seed)
    for mode in args.modes:
        runner = ModelRunner(model, most, max_len, device=args.device, deterministic=mode == "deterministic",
                             cuda_graphs=mode in ("default", "overlapped"))
        for context in args.context:
            prefill_slot(runner, 0, random_tokens(generator, model.config.vocab_size, context), args.prefill_chunk)
            copy_slot_to_all(runner, most)
            positions = [context] * most
            for concurrency in args.concurrency:
                measured = decode_steps(runner, positions, concurrency, args.steps, args.row_budget_s, generator,
                                        overlapped=mode == "overlapped")
                row = {"bench": "slice.decode", "mode": mode, "concurrency": concurrency, "context": context}
                emit({**row, **roofline(runner, measured, concurrency, copy_bps)}, fields)
        del runner


def cmd_profile(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> None:
    """Where a decode step's device time goes: torch.profiler over --steps steps per concurrency at
    context 0 (graph replays included: CUPTI reports the kernels inside them), one line per kernel
    name with calls and microseconds per step, heaviest first (--top of them), then the step total."""
    from torch.profiler import ProfilerActivity, profile

    most = max(args.concurrency)
    runner = ModelRunner(model, most, 4096, device=args.device, cuda_graphs=not args.enforce_eager)
    generator = torch.Generator().manual_seed(args.seed)
    for concurrency in args.concurrency:
        positions = [0] * most
        decode_steps(runner, positions, concurrency, 3, 1.0, generator)  # warm-up
        on_gpu = args.device == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            decode_steps(runner, positions, concurrency, args.steps, 60.0, generator)
        steps = args.steps + (2 if runner.graphs is not None else 1)  # decode_steps' untimed probe (and replay) first
        kind = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
        events = [e for e in prof.key_averages() if e.device_type == kind]
        spent = {id(e): e.self_device_time_total if on_gpu else e.self_cpu_time_total for e in events}
        events.sort(key=lambda e: spent[id(e)], reverse=True)
        for event in events[: args.top]:
            emit({"bench": "slice.profile", "concurrency": concurrency, "kernel": event.key[:160],
                  "calls_per_step": event.count / steps, "us_per_step": spent[id(event)] / steps}, fields)
        emit({"bench": "slice.profile.total", "concurrency": concurrency, "graphs": runner.graphs is not None,
              "kernels_per_step": sum(e.count for e in events) / steps,
              "device_us_per_step": sum(spent.values()) / steps}, fields)


def cmd_families(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> None:
    """Per concurrency: the decode step on graphs (p50), then each kernel family replayed alone."""
    copy_bps, _ = ceilings(args, model, fields)
    most = max(args.concurrency)
    runner = ModelRunner(model, most, 4096, device=args.device, cuda_graphs=args.device == "cuda")
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    for concurrency in args.concurrency:
        positions = [0] * most
        measured = decode_steps(runner, positions, concurrency, args.steps, args.row_budget_s, generator)
        tokens = random_tokens(generator, vocab, concurrency)
        plan = StepPlan(tuple(chunk(runner, s, [tokens[s]], positions[s]) for s in range(concurrency)))
        graphs, runner.graphs = runner.graphs, None  # an eager step, so the hooks see every module call
        with routed_experts(model) as touched:
            families = capture_families(model, lambda: runner.execute(plan))
        runner.graphs = graphs
        row = {"bench": "slice.family", "concurrency": concurrency, "step_us_p50": 1000 * measured["step_ms_p50"]}
        for family in family_rows(model, families, touched, measured["step_ms_p50"], copy_bps, args.device, args.repeats):
            emit({**row, **family}, fields)
        del families


def cmd_verify(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> None:
    """Per concurrency: the plain decode step, then a verify step of each K (see the module docstring)."""
    ceilings(args, model, fields)
    most = max(args.concurrency)
    generator = torch.Generator().manual_seed(args.seed)
    plain: dict[int, float] = {}
    for drafts in args.draft_tokens:  # a runner per K: its verify graphs have exactly 1 + K rows a sequence
        runner = ModelRunner(model, most, 4096, device=args.device, cuda_graphs=args.device == "cuda",
                             draft_tokens=drafts)
        for concurrency in args.concurrency:
            if concurrency not in plain:
                plain[concurrency] = decode_steps(runner, [0] * most, concurrency, args.steps, args.row_budget_s,
                                                  generator)["step_ms_p50"]
            measured = verify_steps(runner, concurrency, drafts, args.steps, args.row_budget_s, generator)
            emit({"bench": "slice.verify", "concurrency": concurrency, "draft_tokens": drafts, **measured,
                  "graphs": runner.graphs is not None, "plain_step_ms_p50": plain[concurrency],
                  "cost_ratio": measured["step_ms_p50"] / plain[concurrency]}, fields)
        del runner
        if args.device == "cuda":
            torch.cuda.empty_cache()


def verify_steps(runner: ModelRunner, concurrency: int, drafts: int, steps: int, budget_s: float,
                 generator: torch.Generator) -> dict[str, Any]:
    """One untimed verify step, then timed ones of slots 0 .. concurrency - 1 from position 0, each the
    last token and `drafts` random drafts, every draft taken as accepted (positions advance by drafts + 1)."""
    vocab = runner.model.config.vocab_size
    positions = [0] * concurrency

    def step() -> None:
        tokens = random_tokens(generator, vocab, concurrency * (drafts + 1))
        plan = StepPlan(tuple(
            replace(chunk(runner, s, tokens[s * (drafts + 1) : s * (drafts + 1) + 1], positions[s]),
                    pages=pages_holding(runner, s, positions[s] + drafts + 1),
                    draft_token_ids=tuple(tokens[s * (drafts + 1) + 1 : (s + 1) * (drafts + 1)]))
            for s in range(concurrency)))
        runner.execute(plan)
        for s in range(concurrency):
            positions[s] += drafts + 1

    step()
    durations = timed_steps(step, steps, budget_s, runner.device)
    return {"steps": len(durations), "step_ms_p50": 1000 * statistics.median(durations),
            "step_ms_p90": 1000 * _p90(durations)}


def prefill_once(runner: ModelRunner, tokens: list[int], chunk_tokens: int) -> float:
    """Seconds from the first chunk's launch to the first sampled token, chunk by chunk from position 0."""
    synchronize(runner.device)
    start = time.perf_counter()
    for first in range(0, len(tokens), chunk_tokens):
        piece = chunk(runner, 0, tokens[first : first + chunk_tokens], first)
        result = runner.execute(StepPlan((replace(piece, sample=first + chunk_tokens >= len(tokens)),)))
    synchronize(runner.device)
    assert result.chunks[0].sampled is not None
    return time.perf_counter() - start


def peak_bytes_of(run: Callable[[], float], device: str) -> tuple[float, int | None]:
    """`run()`'s result and the most device memory it held beyond what was allocated before it (CUDA's
    allocator statistics; None on the CPU, which keeps none)."""
    if device != "cuda":
        return run(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


def cmd_ttft(args: argparse.Namespace, model: torch.nn.Module, fields: dict[str, Any]) -> None:
    """TTFT per prompt length and per prefill chunk size (`--prefill-chunks`, issue 24's sweep), with the
    peak workspace a prefill of that chunk size held on the device."""
    _, matmul_fps = ceilings(args, model, fields)
    runner = ModelRunner(model, 1, max(args.prompt) + 1, device=args.device)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    for chunk_tokens in args.prefill_chunks or [args.prefill_chunk]:
        prefill_once(runner, random_tokens(generator, vocab, min(args.prompt)), chunk_tokens)  # warm-up
        for length in args.prompt:
            timed = [peak_bytes_of(lambda: prefill_once(runner, random_tokens(generator, vocab, length), chunk_tokens),
                                   args.device) for _ in range(args.repeats)]
            times = [seconds for seconds, _ in timed]
            peaks = [peak for _, peak in timed if peak is not None]
            ttft = statistics.median(times)
            flops = prefill_flops(model, length)
            emit({"bench": "slice.ttft", "prompt": length, "prefill_chunk": chunk_tokens, "repeats": args.repeats,
                  "ttft_ms_p50": 1000 * ttft, "ttft_ms_min": 1000 * min(times), "prefill_tokens_per_s": length / ttft,
                  "prefill_flops": flops, "flops_per_s": flops / ttft, "ratio_to_matmul": flops / ttft / matmul_fps,
                  "peak_workspace_bytes": max(peaks) if peaks else None}, fields)


def cmd_transformers(args: argparse.Namespace, model: torch.nn.Module, raw: dict[str, Any], fields: dict[str, Any]) -> None:
    from bench.slice_hf import hf_sharing_weights, time_generate

    if args.weights != "bf16":
        raise SystemExit("transformers shares the slice's bf16 tensors: run it with --weights bf16")
    copy_bps, _ = ceilings(args, model, fields)
    hf = hf_sharing_weights(model, raw, args.hf_experts)
    runner = ModelRunner(model, max(args.concurrency), args.prompt_len + args.steps + 2, device=args.device, cuda_graphs=True)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    warm = torch.tensor([random_tokens(generator, vocab, args.prompt_len)], device=args.device)
    time_generate(hf, warm, 2, args.seed)
    for concurrency in args.concurrency:
        prompts = [random_tokens(generator, vocab, args.prompt_len) for _ in range(concurrency)]
        batch = torch.tensor(prompts, device=args.device)
        hf_first = time_generate(hf, batch, 1, args.seed)
        hf_all = time_generate(hf, batch, args.steps, args.seed)
        hf_decode = concurrency * (args.steps - 1) / (hf_all - hf_first)
        for slot, prompt in enumerate(prompts):
            prefill_slot(runner, slot, prompt, args.prefill_chunk)
        ours = roofline(runner, decode_steps(runner, [args.prompt_len] * concurrency, concurrency, args.steps,
                                             args.row_budget_s, generator), concurrency, copy_bps)
        emit({"bench": "slice.transformers", "concurrency": concurrency, "prompt_len": args.prompt_len,
              "hf_steps": args.steps, "hf_experts": args.hf_experts, "hf_ttft_ms": 1000 * hf_first,
              "hf_tokens_per_s": hf_decode, "hf_generate_tokens_per_s": concurrency * args.steps / hf_all,
              "hf_ratio_to_roofline": hf_decode / ours["roofline_tokens_per_s"],
              **ours, "speedup_vs_hf": ours["tokens_per_s"] / hf_decode}, fields)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("command", choices=["decode", "ttft", "transformers", "profile", "families", "verify"])
    parser.add_argument("--config", default=str(FLASH_CONFIG), help="a deepseek_v4 config.json")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--weights", default="bf16", choices=["bf16", "released"],
                        help="released: MXFP4 experts and FP8 linears kept packed, as model.quantization: checkpoint")
    parser.add_argument("--prefill-activations", default="model", choices=["model", "fp8"],
                        help="fp8: prefill chunks round activations to e4m3 for the released kernels "
                             "(model.prefill_activations; needs --weights released)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-mib", type=int, default=None, help="copy buffer (default 4096 on cuda, 64 on cpu)")
    parser.add_argument("--gemm-n", type=int, default=None, help="GEMM size (default 8192 on cuda, 256 on cpu)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[0, 8192])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["default"],
                        choices=["default", "overlapped", "eager", "deterministic"],
                        help="default: decode steps replay CUDA graphs, one after another; overlapped: the same, each "
                             "launched before the one before it lands (the engine's async scheduling); eager: "
                             "--enforce-eager; deterministic")
    parser.add_argument("--row-budget-s", type=float, default=30.0, help="timing budget of one decode row")
    parser.add_argument("--prompt", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--prompt-len", type=int, default=512, help="transformers: prompt tokens per row")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill chunk (the engine's default)")
    parser.add_argument("--prefill-chunks", type=int, nargs="+",
                        help="ttft: a sweep of chunk sizes (e.g. 2048 4096 8192 16384), each with its peak workspace")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7],
                        help="verify: draft tokens per sequence, one row each")
    parser.add_argument("--top", type=int, default=40, help="profile: kernels listed per concurrency")
    parser.add_argument("--enforce-eager", action="store_true", help="profile: eager steps, no CUDA graphs")
    parser.add_argument("--hf-experts", default="grouped_mm", help="transformers' experts implementation")
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    args.copy_mib = args.copy_mib or (4096 if on_gpu else 64)
    args.gemm_n = args.gemm_n or (8192 if on_gpu else 256)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    raw, model = build_slice(args)
    fields = run_fields(args)
    if args.command == "decode":
        cmd_decode(args, model, fields)
    elif args.command == "ttft":
        cmd_ttft(args, model, fields)
    elif args.command == "profile":
        cmd_profile(args, model, fields)
    elif args.command == "families":
        cmd_families(args, model, fields)
    elif args.command == "verify":
        cmd_verify(args, model, fields)
    else:
        cmd_transformers(args, model, raw, fields)


if __name__ == "__main__":
    main()
