"""Decode throughput of the model runner at several concurrencies, in the default and the
deterministic (batch-invariant) mode (JSON lines on stdout).

    python -m bench.decode [--model DIR] [--concurrency 1 4 16] [--prompt-len 128] [--steps 32]
                           [--modes default deterministic]

Each line: {"bench": "decode", "mode", "concurrency", "prompt_len", "steps", "tokens_per_s",
"step_ms_p50", "device", "dtype", "model", "commit"}. Timings come from this run only; compare figures
from one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from contract import SamplingParams, ScheduledChunk, StepPlan
from contract.config import DEFAULT_MODEL_DIR
from models import load_model
from worker import ModelRunner


def pages_holding(runner: ModelRunner, slot: int, tokens: int) -> tuple[int, ...]:
    """The first pages of the slot's default ones that hold `tokens` tokens (a block manager's table)."""
    return tuple(runner.cache.default_pages(slot)[: -(-tokens // runner.cache.block_tokens)].tolist())


def chunk(runner: ModelRunner, slot: int, tokens: list[int], position: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=str(slot), slot=slot, pages=pages_holding(runner, slot, position + len(tokens)),
        token_ids=tuple(tokens), position=position, sample=True,
        logprob_targets=(), params=SamplingParams(temperature=0.0, max_tokens=1 << 20), num_generated=0,
    )


def bench_decode(runner: ModelRunner, concurrency: int, prompt_len: int, steps: int) -> dict:
    vocab = runner.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=generator).tolist() for _ in range(concurrency)]
    result = runner.execute(StepPlan(tuple(chunk(runner, s, p, 0) for s, p in enumerate(prompts))))
    last = [c.sampled.token_id for c in result.chunks]
    durations = []
    for step in range(steps):
        plan = StepPlan(tuple(chunk(runner, s, [last[s]], prompt_len + step) for s in range(concurrency)))
        if runner.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = runner.execute(plan)
        if runner.device == "cuda":
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
        last = [c.sampled.token_id for c in result.chunks]
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens_per_s": concurrency * steps / sum(durations),
        "step_ms_p50": 1000 * statistics.median(durations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"])
    args = parser.parse_args()
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    max_len = args.prompt_len + args.steps + 1
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for mode in args.modes:
        runner = ModelRunner(model, max(args.concurrency), max_len, device=args.device, deterministic=mode == "deterministic")
        for concurrency in args.concurrency:
            row = {"bench": "decode", "mode": mode, **bench_decode(runner, concurrency, args.prompt_len, args.steps),
                   "device": machine, "threads": torch.get_num_threads(), "dtype": args.dtype, "model": args.model,
                   "commit": commit}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
