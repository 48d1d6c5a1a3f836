"""Kernel timings on the device at V4-Flash widths (JSON lines): each GPU path beside the torch one
it replaces, so a dispatch threshold is a measured choice.

    python -m bench.kernels [--repeats 50]

- moe: routed experts of one layer (256 experts of 4096 x 2048, top-6, random routing) for 1..32
  tokens: `experts_pairwise` (Triton), `experts_grouped` (torch._grouped_mm), with the bytes the
  distinct experts hold and the bandwidth that implies.
- attention: decode attention over window 128 + 512 selected entries, 64 heads of 512: Triton vs
  the torch reference, per batch size.
Times are CUDA-event medians of --repeats calls after 5 warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.slice_roofline import timed_ms
from kernels.attention import decode_attention_reference, decode_attention_triton
from kernels.moe import experts_grouped, experts_pairwise


def median_ms(fn, repeats: int) -> float:
    return statistics.median(timed_ms(fn, "cuda", repeats, warmup=5))


def bench_moe(repeats: int) -> None:
    generator = torch.Generator("cuda").manual_seed(0)
    experts_total, dim, inter, top_k = 256, 4096, 2048, 6
    gate_up = (torch.randn(experts_total, 2 * inter, dim, device="cuda", generator=generator) / 64).bfloat16()
    down = (torch.randn(experts_total, dim, inter, device="cuda", generator=generator) / 45).bfloat16()
    for tokens in (1, 2, 4, 8, 16, 32):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        experts = torch.stack([torch.randperm(experts_total, device="cuda", generator=generator)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
        distinct = int(experts.unique().numel())
        nbytes = distinct * 3 * inter * dim * 2
        for name, fn in (("pairwise", experts_pairwise), ("grouped", experts_grouped)):
            ms = median_ms(lambda: fn(x, weights, experts, gate_up, down, 0, 10.0, False), repeats)
            print(json.dumps({"bench": "kernels.moe", "path": name, "tokens": tokens, "pairs": tokens * top_k,
                              "distinct_experts": distinct, "ms": ms, "bytes": nbytes,
                              "bytes_per_s": nbytes / ms * 1e3}), flush=True)


def sweep_pairwise_blocks(repeats: int) -> None:
    """The pairwise kernels' block shapes, at 1 and 32 tokens (the defaults in kernels/moe.py come
    from this sweep)."""
    generator = torch.Generator("cuda").manual_seed(2)
    experts_total, dim, inter, top_k = 256, 4096, 2048, 6
    gate_up = (torch.randn(experts_total, 2 * inter, dim, device="cuda", generator=generator) / 64).bfloat16()
    down = (torch.randn(experts_total, dim, inter, device="cuda", generator=generator) / 45).bfloat16()
    for tokens in (1, 32):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        experts = torch.stack([torch.randperm(experts_total, device="cuda", generator=generator)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
        for blocks in ((8, 512), (16, 256), (16, 128), (32, 128), (32, 64), (64, 64)):
            for which in ("gate_up", "down"):
                chosen = {f"{which}_blocks": blocks}
                ms = median_ms(lambda: experts_pairwise(x, weights, experts, gate_up, down, 0, 10.0, False, **chosen), repeats)
                print(json.dumps({"bench": "kernels.moe_blocks", "tokens": tokens, "varied": which, "blocks": blocks,
                                  "ms": ms}), flush=True)


def bench_attention(repeats: int) -> None:
    generator = torch.Generator("cuda").manual_seed(1)
    heads, dim, n_keys = 64, 512, 128 + 512
    sinks = torch.randn(heads, device="cuda", generator=generator)
    for batch in (1, 8, 32):
        q = torch.randn(batch, heads, dim, device="cuda", generator=generator).bfloat16()
        keys = torch.randn(batch, n_keys, dim, device="cuda", generator=generator).bfloat16()
        valid = torch.rand(batch, n_keys, device="cuda", generator=generator) < 0.9
        for name, fn in (("triton", decode_attention_triton), ("torch", decode_attention_reference)):
            ms = median_ms(lambda: fn(q, keys, valid, sinks, dim**-0.5), repeats)
            print(json.dumps({"bench": "kernels.attention", "path": name, "batch": batch, "keys": n_keys, "ms": ms}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    bench_moe(args.repeats)
    sweep_pairwise_blocks(args.repeats)
    bench_attention(args.repeats)


if __name__ == "__main__":
    main()
