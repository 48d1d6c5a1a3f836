"""Engram tiers under decode: tokens/s with the tables on the device, in RAM, and on disk (cold and
warm row cache), on a V4.1 model whose Engram tables are several GB (JSON lines on stdout).

    python -m bench.engram [--dir /var/tmp/ds4-engram-bench] [--table-gb 4] [--runs 5] [--steps 24]
                           [--cuda-graphs] [--engram-layers 1 4]

The checkpoint is the tiny V4.1 with 256-wide Engram rows and prime table sizes chosen so the two
tables take about --table-gb on disk (written once, streamed, then converted to table files). Prompts
draw tokens from a Zipf law (s = --zipf) over the vocabulary, so n-gram rows are hit the way real text
hits them. The host row cache is at most 10% of the table. Modes are interleaved run by run, in an order
that rotates each run (disk_warm always right after disk_cold, whose reads warm its cache), each run
starts after a garbage collection, and each figure is the median of --runs runs. `--profile MODE ...`
prints those modes' cProfile (top functions by own time) to stderr after the last run. Keys: mode (gpu | host | disk_cold | disk_warm), concurrency,
tok_s, prefetch_wait_p50_ms, prefetch_wait_p99_ms, hit_rate, iops, plus machine and commit.
`--cuda-graphs` runs the model in bf16 with decode steps replaying CUDA graphs and adds
`graph_engram_wait_ms` (per step: the time a step waits for its rows before its replay);
`--engram-layers` picks the Engram layers (0 puts one first, where no layer runs before the wait).
`--fetch-only` times only the Engram fetch of a decode step per tier (gpu, host, disk_cold with every
row read while the step waits, disk_warm; median of --steps fetches, then of --runs interleaved rounds)
and prints `fetch_ms` and `extra_ms_vs_gpu`: the host work a tier adds to every step, measurable on a
CPU too.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from contract import SamplingParams, ScheduledChunk, StepPlan
from engram_store.store import DiskLayer, EngramOptions
from models import ModelConfig, load_model
from models.engram_setup import engram_hasher
from models.tiny import build_tokenizer, random_weights, tiny_v41_config_dict
from worker import ModelRunner

ROW_DIM = 256
CHUNK_ROWS = 1 << 18


def write_big_safetensors(path: Path, tables: list[tuple[int, int]], seed: int) -> None:
    """Streams random fp8 tables with power-of-two scales into one safetensors file (the library writes
    only whole in-memory tensors). tables: (layer id, rows)."""
    entries, offset = {}, 0
    for layer, rows in tables:
        for name, dtype, width in ((f"model.engram_tables.{layer}.weight", "F8_E4M3", ROW_DIM),
                                   (f"model.engram_tables.{layer}.weight_scale_inv", "F32", ROW_DIM // 32 * 4)):
            size = rows * width
            entries[name] = {"dtype": dtype, "shape": [rows, ROW_DIM if dtype == "F8_E4M3" else ROW_DIM // 32],
                             "data_offsets": [offset, offset + size]}
            offset += size
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        for layer, rows in tables:
            for start in range(0, rows, CHUNK_ROWS):  # values: any e4m3 code but the NaNs (0x7f, 0xff)
                block = rng.integers(0, 256, size=(min(CHUNK_ROWS, rows - start), ROW_DIM), dtype=np.uint8)
                block[(block & 0x7F) == 0x7F] -= 1
                out.write(block.tobytes())
            for start in range(0, rows, CHUNK_ROWS):
                exponents = rng.integers(-12, -4, size=(min(CHUNK_ROWS, rows - start), ROW_DIM // 32))
                out.write(np.exp2(exponents).astype(np.float32).tobytes())


def make_checkpoint(directory: Path, table_gb: float, engram_layers: list[int]) -> Path:
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory / "tokenizer.json")
    columns = 2 * 2  # 2-grams and 3-grams, 2 heads
    rows_per_layer = int(table_gb * 2**30 / 2 / (ROW_DIM + 8) * 15 / 15.2)
    raw = tiny_v41_config_dict(engram_head_dim=ROW_DIM, engram_vocab_size=rows_per_layer // columns,
                               engram_layer_ids=engram_layers)
    config = ModelConfig.from_dict(raw)
    hasher = engram_hasher(config.engram, Tokenizer.from_file(str(directory / "tokenizer.json")))
    raw["engram_compressed_vocab_size"] = int(hasher.lookup.max()) + 1
    raw["engram_num_embeddings"] = list(hasher.layout.num_embeddings)
    config = ModelConfig.from_dict(raw)
    save_file({k: v.contiguous() for k, v in random_weights(config, engram_tables=False).items()}, str(directory / "model.safetensors"))
    write_big_safetensors(directory / "engram.safetensors", list(zip(config.engram.layer_ids, config.engram.num_embeddings)), 0)
    names = {name: "model.safetensors" for name in random_weights(config, engram_tables=False)}
    for layer in config.engram.layer_ids:
        names[f"model.engram_tables.{layer}.weight"] = names[f"model.engram_tables.{layer}.weight_scale_inv"] = "engram.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    return directory


def zipf_prompts(vocab: int, n: int, length: int, s: float, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab - 6, dtype=np.float64)
    weights = ranks**-s / (ranks**-s).sum()
    order = rng.permutation(np.arange(7, vocab))  # which token ids are frequent: arbitrary, fixed
    return [order[rng.choice(len(ranks), size=length, p=weights)].tolist() for _ in range(n)]


def chunk(runner: ModelRunner, slot: int, tokens: list[int], position: int) -> ScheduledChunk:
    return ScheduledChunk(request_id=str(slot), slot=slot, pages=tuple(runner.cache.default_pages(slot).tolist()),
                          token_ids=tuple(tokens), position=position, sample=True, logprob_targets=(),
                          params=SamplingParams(temperature=0.0, max_tokens=1 << 20), num_generated=0)


def run_once(runner: ModelRunner, prompts: list[list[int]], steps: int) -> dict:
    store = runner.model.engram_memory.source  # an EngramStore: every runner here is built with options
    stats, disk = store.stats, disk_layers(runner)
    before = (sum(l.host_cache.hits for l in disk), sum(l.host_cache.misses for l in disk), disk_reads(runner))
    stats.recent_waits_s.clear()
    graph_wait = runner.graphs.engram_wait_s if runner.graphs is not None else 0.0
    result = runner.execute(StepPlan(tuple(chunk(runner, s, p, 0) for s, p in enumerate(prompts))))
    last = [c.sampled.token_id for c in result.chunks]
    start = time.perf_counter()
    for step in range(steps):
        plan = StepPlan(tuple(chunk(runner, s, [last[s]], len(prompts[s]) + step) for s in range(len(prompts))))
        result = runner.execute(plan)
        last = [c.sampled.token_id for c in result.chunks]
    if runner.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    graph_wait = (runner.graphs.engram_wait_s - graph_wait) if runner.graphs is not None else None
    waits = sorted(stats.recent_waits_s) or [0.0]
    hits = sum(l.host_cache.hits for l in disk) - before[0]
    misses = sum(l.host_cache.misses for l in disk) - before[1]
    reads = disk_reads(runner) - before[2]
    return {
        "tok_s": len(prompts) * steps / elapsed,
        "prefetch_wait_p50_ms": 1000 * waits[len(waits) // 2],
        "prefetch_wait_p99_ms": 1000 * waits[min(len(waits) - 1, int(len(waits) * 0.99))],
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "iops": reads / elapsed,
        "graph_engram_wait_ms": None if graph_wait is None else 1000 * graph_wait / steps,
    }


def fetch_once(runner: ModelRunner, prompts: list[list[int]], cold: bool = False) -> float:
    """Seconds one decode step's Engram fetch takes (`engram_rows`: hashing, the tier's lookups and
    reads, rows ready on the device), the sequences' look-backs restored after it so that every call
    asks for the same rows. `cold`: the row caches emptied first, so every row is read from disk."""
    context = runner.cache.engram_context
    saved = context.clone()
    if cold:
        clear_caches(runner)
    slots = list(range(len(prompts)))
    began = time.perf_counter()
    runner.model.engram_rows(slots, [p[-1] for p in prompts], [len(p) for p in prompts], runner.cache)
    if runner.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    context.copy_(saved)
    return elapsed


def fetch_only(runners: dict[str, ModelRunner], args: argparse.Namespace, machine: str, commit: str) -> None:
    """--fetch-only: the Engram fetch of a decode step alone, per tier, without the model: the host
    time a tier adds to every step. disk_cold reads every row of the step from disk while the step
    waits (no hint started them a step earlier): the worst case. Rounds interleave the tiers; medians."""
    vocab = runners["gpu"].model.config.vocab_size
    for concurrency in args.concurrency:
        prompts = zipf_prompts(vocab, concurrency, args.prompt_len, args.zipf, seed=0)
        for runner in runners.values():
            run_once(runner, prompts, 0)  # the prompts' look-backs in the cache
            fetch_once(runner, prompts)  # disk: the rows read and cached (warm from here on)
        times: dict[str, list[float]] = {"gpu": [], "host": [], "disk_cold": [], "disk_warm": []}
        for _ in range(args.runs):
            for mode, samples in times.items():
                runner = runners["disk" if mode.startswith("disk") else mode]
                cold = mode == "disk_cold"
                samples.append(statistics.median(fetch_once(runner, prompts, cold) for _ in range(args.steps)))
                if cold:
                    fetch_once(runner, prompts)  # warm again for disk_warm
        gpu_ms = 1000 * statistics.median(times["gpu"])
        for mode, samples in times.items():
            fetch_ms = 1000 * statistics.median(samples)
            print(json.dumps({"bench": "engram_fetch", "mode": mode, "concurrency": concurrency, "fetch_ms": fetch_ms,
                              "extra_ms_vs_gpu": fetch_ms - gpu_ms, "runs": args.runs, "steps": args.steps,
                              "device": machine, "commit": commit}), flush=True)


def disk_layers(runner: ModelRunner) -> list[DiskLayer]:
    """The runner's disk-resident Engram layers (none in the gpu and host modes)."""
    disk = runner.model.engram_memory.source.tiers.get("disk")
    return [] if disk is None else list(disk.layers.values())


def disk_reads(runner: ModelRunner) -> int:
    """Pages read from the table files since start."""
    disk = runner.model.engram_memory.source.tiers.get("disk")
    return 0 if disk is None else disk.reader.reads


def clear_caches(runner: ModelRunner) -> None:
    for layer in disk_layers(runner):
        layer.host_cache.clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/ds4-engram-bench"))
    parser.add_argument("--table-gb", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cuda-graphs", action="store_true", help="bf16, decode steps on CUDA graphs")
    parser.add_argument("--engram-layers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--profile", nargs="+", default=[], choices=["gpu", "host", "disk_cold", "disk_warm"])
    parser.add_argument("--fetch-only", action="store_true", help="time the Engram fetch of a step alone, per tier")
    args = parser.parse_args(argv)
    layers = "-".join(map(str, args.engram_layers))
    model_dir = make_checkpoint(args.dir / f"model-engram-{layers}", args.table_gb, args.engram_layers)
    table_bytes = sum(p.stat().st_size for p in model_dir.glob("engram.safetensors"))
    host_cache = int(0.1 * table_bytes)
    modes = {
        "gpu": EngramOptions(residency="gpu"),
        "host": EngramOptions(residency="host"),
        "disk": EngramOptions(residency="disk", path=args.dir / f"tables-{layers}", host_cache_bytes=host_cache, queue_depth=64),
    }
    max_len = args.prompt_len + args.steps + 2
    runners = {}
    for name, options in modes.items():
        dtype = torch.bfloat16 if args.cuda_graphs else torch.float32
        model = load_model(model_dir, device=args.device, engram=options, dtype=dtype)
        runners[name] = ModelRunner(model, max(args.concurrency), max_len, device=args.device, cuda_graphs=args.cuda_graphs)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.fetch_only:
        fetch_only(runners, args, machine, commit)
        return
    vocab = runners["gpu"].model.config.vocab_size
    for concurrency in args.concurrency:
        results: dict[str, list[dict]] = {m: [] for m in ("gpu", "host", "disk_cold", "disk_warm")}
        warmup = zipf_prompts(vocab, concurrency, args.prompt_len, args.zipf, seed=10_000)
        for runner in runners.values():  # first-call costs (allocator, threads) out of the figures
            run_once(runner, warmup, 2)
        units = [["gpu"], ["host"], ["disk_cold", "disk_warm"]]
        profilers = {mode: cProfile.Profile() for mode in args.profile}
        for run in range(args.runs):  # interleaved: every mode once per round, the order rotating
            prompts = zipf_prompts(vocab, concurrency, args.prompt_len, args.zipf, seed=run)
            for mode in [m for unit in units[run % 3 :] + units[: run % 3] for m in unit]:
                runner = runners["disk" if mode.startswith("disk") else mode]
                if mode == "disk_cold":
                    clear_caches(runner)
                gc.collect()
                if mode in profilers:
                    profilers[mode].enable()
                results[mode].append(run_once(runner, prompts, args.steps))
                if mode in profilers:
                    profilers[mode].disable()
        for mode, profiler in profilers.items():
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(f"profile of {mode}, concurrency {concurrency}:\n{text.getvalue()}", file=sys.stderr)
        for mode, rows in results.items():
            line = {"bench": "engram", "mode": mode, "concurrency": concurrency}
            for key in rows[0]:
                values = [r[key] for r in rows if r[key] is not None]
                line[key] = statistics.median(values) if values else None
            line.update({"runs": args.runs, "table_bytes": table_bytes, "host_cache_bytes": host_cache,
                         "device": machine, "commit": commit})
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
