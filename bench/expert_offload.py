"""Decode with expert offload (issue 28): an N-layer slice with each MoE layer's experts split between
the device and host RAM (models/expert_offload.py), under controlled routing skew, beside the bound
the two memories imply (JSON lines).

    python -m bench.expert_offload [--concurrency 1 8] [--skew uniform zipf1.0 zipf1.2]
                                   [--resident 64] [--staging 32] [--steps 16] [--row-budget-s 10]
    common: bench/slice.py's [--config ...] [--layers 4] [--device cuda|cpu] [--dtype bfloat16]
            [--weights released|bf16] [--seed 0] [--copy-mib 4096]

Routing skew: each router's expert choice is replaced by a draw of top-k distinct experts from a Zipf
law over the layer's experts (rank r chosen with weight r^-s, ranks a seeded permutation of the ids;
uniform is s = 0), by a hook on the router, seeded per step. A bias on the router's scores would only
tilt them, whose skew then depends on the scores; the draw fixes it exactly. The routing weights are
the router's own. The same draws feed a run with every expert resident (`resident_tokens_per_s`).

Per (skew, concurrency): decode tokens/s with offload and with every expert resident, the bytes a step
reads from the device (dense weights, every expert it routed to: resident ones and staged copies) and
copies from host RAM (the staged experts; from the cache's counts), the device-copy and host-to-device
bandwidths measured in this run, and the bound they imply: device bytes / device bandwidth + host bytes
/ host-to-device bandwidth a step; `ratio_to_bound` is the bound's step time over the measured one.
The offloaded path reads each step's routing on the host (one sync a layer), so both runs are eager.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch

from bench.slice import build_slice, decode_steps, emit, run_fields
from bench.slice_roofline import copy_bandwidth, timed_ms, weight_bytes_read
from models.expert_offload import OffloadedExperts, offload_experts
from models.moe import Router
from worker import ModelRunner

SKEWS = {"uniform": 0.0, "zipf1.0": 1.0, "zipf1.2": 1.2}


def host_to_device_bandwidth(device: str, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Bytes/s of a pinned host-to-device copy (on the CPU: a host copy), median of `repeats`."""
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, pin_memory=device == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = statistics.median(timed_ms(lambda: target.copy_(source, non_blocking=True), device, repeats))
    return {"bench": "expert_offload.h2d", "bytes": nbytes, "ms_p50": ms, "bytes_per_s": nbytes / (ms / 1000)}


@contextmanager
def zipf_routing(model: torch.nn.Module, s: float, seed: int) -> Iterator[None]:
    """Every router's experts drawn from Zipf(s) over a seeded permutation of its experts (see the
    module docstring); the draws follow a generator seeded once, so two runs see the same routing."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    experts = model.config.n_routed_experts
    permutation = torch.Generator().manual_seed(seed)
    law = [torch.empty(experts).scatter_(0, torch.randperm(experts, generator=permutation),
                                         torch.arange(1, experts + 1, dtype=torch.float).pow(-s))
           for _ in routers]
    draws = torch.Generator().manual_seed(seed + 1)

    def hook(index: int):
        def replace_choice(module, inputs, output):
            weights, ids = output
            picked = torch.multinomial(law[index].expand(ids.shape[0], -1), ids.shape[1], generator=draws)
            return weights, picked.to(device=ids.device, dtype=ids.dtype)
        return replace_choice

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def stats_of(model: torch.nn.Module) -> Counter:
    """The offload caches' counts (models/expert_offload.py OffloadStats), summed over the layers."""
    totals: Counter = Counter()
    for cache in (m for m in model.modules() if isinstance(m, OffloadedExperts)):
        totals.update(asdict(cache.stats))
    return totals


def run(args: argparse.Namespace) -> None:
    _, model = build_slice(args)
    fields = run_fields(args)
    copy = copy_bandwidth(args.device, args.copy_mib * 2**20)
    emit(copy, fields)
    h2d = host_to_device_bandwidth(args.device, args.copy_mib * 2**20)
    emit(h2d, fields)
    most, max_len = max(args.concurrency), args.steps + 8  # each row decodes from position 0

    def decode(runner: ModelRunner, skew: str, concurrency: int) -> dict[str, Any]:
        with zipf_routing(model, SKEWS[skew], args.seed):
            return decode_steps(runner, [0] * most, concurrency, args.steps, args.row_budget_s,
                                torch.Generator().manual_seed(args.seed))

    resident_runner = ModelRunner(model, most, max_len, device=args.device, cuda_graphs=False)
    resident = {}
    for skew in args.skew:  # every expert resident first, on the same routing draws
        for concurrency in args.concurrency:
            measured = decode(resident_runner, skew, concurrency)
            # what a step reads from the device: dense weights and every expert it routed to
            measured["device_bytes"] = weight_bytes_read(model, measured["experts_touched"], concurrency)
            resident[skew, concurrency] = measured
    del resident_runner
    layers = offload_experts(model, args.resident, args.staging)
    runner = ModelRunner(model, most, max_len, device=args.device, cuda_graphs=False)
    for skew in args.skew:
        for concurrency in args.concurrency:
            before = stats_of(model)
            measured = decode(runner, skew, concurrency)
            after = stats_of(model)
            steps = measured["steps"] + 1  # decode_steps' untimed probe step copies too
            host_bytes = (after["copied_bytes"] - before["copied_bytes"]) / steps
            device_bytes = resident[skew, concurrency]["device_bytes"]
            bound_s = device_bytes / copy["bytes_per_s"] + host_bytes / h2d["bytes_per_s"]
            emit({
                "bench": "expert_offload.decode", "skew": skew, "concurrency": concurrency, "layers": layers,
                "resident_per_layer": args.resident, "staging": args.staging, "steps": measured["steps"],
                "tokens_per_s": measured["tokens_per_s"], "step_ms_p50": measured["step_ms_p50"],
                "resident_tokens_per_s": resident[skew, concurrency]["tokens_per_s"],
                "device_bytes_per_step": device_bytes, "host_bytes_per_step": host_bytes,
                "copies_per_step": (after["copies"] - before["copies"]) / steps,
                "staging_hits_per_step": (after["staging_hits"] - before["staging_hits"]) / steps,
                "bound_step_ms": 1000 * bound_s, "bound_tokens_per_s": concurrency / bound_s,
                "ratio_to_bound": bound_s / (measured["step_ms_p50"] / 1000),
            }, fields)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This bench's flags, then bench/slice.py's common ones (decode's defaults: 1 and 8 streams)."""
    from bench.slice import parse_args as slice_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skew", nargs="+", default=list(SKEWS), choices=list(SKEWS))
    parser.add_argument("--resident", type=int, default=64, help="experts a layer kept on the device")
    parser.add_argument("--staging", type=int, default=64, help="device slots for host experts a layer")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    known, rest = parser.parse_known_args(argv)
    args = slice_args(["decode", *rest])
    for key, value in vars(known).items():
        setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
