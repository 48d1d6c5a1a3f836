"""Kernel timings on the device at V4-Flash widths (JSON lines): each GPU path beside the torch one
it replaces, so a dispatch threshold is a measured choice.

    python -m bench.kernels [--repeats 50]

- moe: routed experts of one layer (256 experts of 4096 x 2048, top-6, random routing) for 1..32
  tokens: `experts_pairwise` (Triton), `experts_grouped` (torch._grouped_mm), with the bytes the
  distinct experts hold and the bandwidth that implies.
- moe_mxfp4: the same layer with MXFP4 experts (as released): the pairwise kernels beside the
  tensor-core kernels of kernels/moe_mxfp4.py (decode: `by_expert`, scanning; prefill: `sorted`, and
  the reference's dequantizing loop), each with every upcast of `UPCASTS` (`dot_scaled`, the bit
  decode, the PTX decode) over a sweep of block shapes; bytes are the distinct experts' packed bytes.
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
from kernels.moe import MXFP4Experts, experts_grouped, experts_pairwise, experts_reference
from kernels.moe_mxfp4 import UPCASTS, experts_by_expert, experts_sorted
from kernels.quant import quantize_mxfp4


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


def _mxfp4_layer(generator: torch.Generator, experts_total: int, dim: int, inter: int) -> tuple[MXFP4Experts, MXFP4Experts]:
    """Random MXFP4 experts, quantized 16 at a time (a float32 copy of all 256 would take 25 GB)."""
    projections = []
    for rows, cols in ((2 * inter, dim), (dim, inter)):
        parts = [quantize_mxfp4(torch.randn(16, rows, cols, device="cuda", generator=generator) / cols**0.5)
                 for _ in range(experts_total // 16)]
        projections.append(MXFP4Experts(torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])))
    return projections[0], projections[1]


def bench_moe_mxfp4(repeats: int) -> None:
    generator = torch.Generator("cuda").manual_seed(3)
    experts_total, dim, inter, top_k = 256, 4096, 2048, 6
    gate_up, down = _mxfp4_layer(generator, experts_total, dim, inter)
    per_expert = sum(w.codes[0].numel() + w.scales[0].numel() for w in (gate_up, down))
    decode = [{"gate_up": (16, n, k, w), "down": (16, n, k, w)} for n, k, w in
              ((64, 128, 4), (32, 128, 4), (64, 256, 4), (128, 128, 4))]
    prefill = [{"gate_up": (m, n, k, w), "down": (m, n, k, w)} for m, n, k, w in ((64, 64, 128, 4), (128, 128, 128, 8))]
    for tokens in (1, 4, 8, 32, 64, 128, 512, 2048, 8192):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        scores = torch.rand(tokens, experts_total, device="cuda", generator=generator)
        experts = scores.topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
        distinct = int(experts.unique().numel())
        nbytes = distinct * per_expert
        args = (x, weights, experts, gate_up, down, 0, 10.0, False)
        want = experts_reference(*args) if tokens <= 2048 else None
        runs = []
        if tokens <= 128:
            runs.append(("pairwise", None, lambda: experts_pairwise(*args)))
            runs += [(f"by_expert_{u}", b, (lambda b=b, u=u: experts_by_expert(*args, blocks=b, upcast=u)))
                     for b in decode for u in UPCASTS]
        if tokens >= 32:
            runs += [(f"sorted_{u}", b, (lambda b=b, u=u: experts_sorted(*args, blocks=b, upcast=u)))
                     for b in prefill for u in UPCASTS]
        if tokens >= 512:
            runs.append(("reference", None, lambda: experts_reference(*args)))
        for name, blocks, fn in runs:
            try:
                error = None if want is None else float((fn() - want).abs().max() / want.abs().max())
                ms = median_ms(fn, repeats if tokens <= 512 else 5)
            except Exception as exc:  # a block shape the compiler refuses: reported, the sweep goes on
                print(json.dumps({"bench": "kernels.moe_mxfp4", "path": name, "tokens": tokens, "blocks": blocks,
                                  "failed": repr(exc)[:300]}), flush=True)
                continue
            print(json.dumps({"bench": "kernels.moe_mxfp4", "path": name, "tokens": tokens, "pairs": tokens * top_k,
                              "blocks": blocks, "distinct_experts": distinct, "ms": ms, "bytes": nbytes,
                              "bytes_per_s": nbytes / ms * 1e3, "rel_err": error}), flush=True)


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


BENCHES = {"moe": (bench_moe, sweep_pairwise_blocks), "moe_mxfp4": (bench_moe_mxfp4,), "attention": (bench_attention,)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--only", choices=sorted(BENCHES), help="one family (default: all)")
    args = parser.parse_args()
    for name, benches in BENCHES.items():
        if args.only in (None, name):
            for bench in benches:
                bench(args.repeats)


if __name__ == "__main__":
    main()
