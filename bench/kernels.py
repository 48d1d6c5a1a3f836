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
- moe_mxfp4_fp8: the same layer laid out as the server holds it (kernels/mma_layout.py) at prefill
  sizes: the bf16-activation sorted kernels (their dispatched tiles) beside kernels/moe_mxfp4_fp8.py's
  FP8-activation ones over a sweep of tiles, with useful TFLOP/s and each path's relative error (norm)
  against the bf16 path's result (the FP8 path's rounding, not a bug: its exactness is tests/'s job).
- mxfp4_decode: the scanning kernels' tiles, pipelining depths and K shares for 1..32 tokens (the
  defaults DECODE_BLOCKS / DECODE_SPLITS come from its `.best` lines), bytes/s against the copy bandwidth.
- router: the router's logits grid (LOGITS_CONFIG comes from its `.best` lines).
- attention: decode attention over window 128 + 512 selected entries, 64 heads of 512: Triton vs
  the torch reference, per batch size.
Times are CUDA-event medians of --repeats calls after 5 warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.fp8_linear import time_graph
from bench.slice_roofline import timed_ms
from kernels.attention import decode_attention_reference, decode_attention_triton
from kernels.moe import MXFP4Experts, experts_grouped, experts_pairwise, experts_reference
from kernels.mma_layout import from_released
from kernels.moe_mxfp4 import UPCASTS, Tile, decode_splits, experts_by_expert, experts_sorted
from kernels.moe_mxfp4_fp8 import STEP, experts_sorted_fp8
from kernels.quant import quantize_mxfp4
from kernels.router import LOGITS_CONFIG, LogitsConfig, route_triton


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


# the decode sweeps time CUDA graphs of GRAPH_CALLS calls (a replay has no host launch cost, as in a
# captured decode step), cycling through inputs that together exceed the 60 MB L2
GRAPH_CALLS = 20
ROUTINGS = 4  # expert choices cycled by the MXFP4 decode sweep
ROUTER_COPIES = 40  # router weights (2 MB each) cycled by the router sweep


def sweep_mxfp4_decode(repeats: int) -> None:
    """The scanning MXFP4 kernels' decode knobs (kernels/moe_mxfp4.py DECODE_BLOCKS, DECODE_SPLITS): tile
    and pipelining depth x K shares of (gate_up, down), 1..32 tokens, PTX upcast; bytes/s against the
    copy bandwidth of this run. The summary line per token count names the fastest (tile, shares)."""
    from bench.slice_roofline import copy_bandwidth

    copy = copy_bandwidth("cuda", 4 << 30)
    print(json.dumps({"bench": "kernels.copy", **copy}), flush=True)
    generator = torch.Generator("cuda").manual_seed(4)
    experts_total, dim, inter, top_k = 256, 4096, 2048, 6
    gate_up, down = _mxfp4_layer(generator, experts_total, dim, inter)
    per_expert = sum(w.codes[0].numel() + w.scales[0].numel() for w in (gate_up, down))
    tiles = [Tile(16, 128, 128, 4, stages) for stages in (2, 3, 4)] + [Tile(16, 64, 128, 4, 3), Tile(16, 128, 256, 4, 3),
                                                                        Tile(16, 64, 256, 4, 3)]
    shares = [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)]
    for tokens in (1, 2, 4, 8, 16, 32):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        routings = [torch.rand(tokens, experts_total, device="cuda", generator=generator).topk(top_k, dim=-1).indices
                    for _ in range(ROUTINGS)]
        weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
        nbytes = statistics.mean(int(e.unique().numel()) for e in routings) * per_expert
        want = experts_reference(x, weights, routings[0], gate_up, down, 0, 10.0, False)
        best = None
        for tile in tiles:
            for split in shares:
                row = {"bench": "kernels.mxfp4_decode", "tokens": tokens, "tile": list(tile), "splits": list(split),
                       "default_splits": list(decode_splits(tokens * top_k))}

                def call(i: int, tile: Tile = tile, split: tuple[int, int] = split):
                    return lambda: experts_by_expert(x, weights, routings[i], gate_up, down, 0, 10.0, False,
                                                     blocks={"gate_up": tile, "down": tile}, upcast="ptx", splits=split)
                try:
                    row["rel_err"] = float((call(0)() - want).abs().max() / want.abs().max())
                    row["ms"] = time_graph(call, ROUTINGS, GRAPH_CALLS, max(3, repeats // 10))
                except Exception as exc:  # a shape the compiler refuses: reported, the sweep goes on
                    row["failed"] = repr(exc)[:300]
                    print(json.dumps(row), flush=True)
                    continue
                row.update(bytes=nbytes, bytes_per_s=nbytes / row["ms"] * 1e3,
                           of_copy_bw=nbytes / row["ms"] * 1e3 / copy["bytes_per_s"])
                print(json.dumps(row), flush=True)
                if best is None or row["ms"] < best["ms"]:
                    best = row
        print(json.dumps({**best, "bench": "kernels.mxfp4_decode.best"}), flush=True)


def sweep_router(repeats: int) -> None:
    """The router's logits grid (kernels/router.py LogitsConfig) at V4-Flash widths (256 experts x 4096,
    top-6, hashed and not), 1..32 tokens; the summary line per token count names the fastest."""
    generator = torch.Generator("cuda").manual_seed(5)
    experts_total, dim, top_k = 256, 4096, 6
    bias = torch.randn(experts_total, device="cuda", generator=generator)
    configs = [LOGITS_CONFIG] + [LogitsConfig(e, k, s, w) for e in (8, 16, 32) for k, s in
                                 ((512, 1), (512, 2), (512, 4), (256, 8), (512, 8), (256, 16)) for w in (4,)]
    copies = [torch.randn(experts_total, dim, device="cuda", generator=generator).bfloat16() for _ in range(ROUTER_COPIES)]
    for tokens in (1, 8, 32):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        ids = torch.zeros(tokens, dtype=torch.int64, device="cuda")
        best = None
        for config in configs:
            def call(i: int, config: LogitsConfig = config):
                return lambda: route_triton(x, copies[i], ids, top_k, 1.0, 1.5, True, bias=bias, config=config)
            row = {"bench": "kernels.router", "tokens": tokens, "config": list(config),
                   "default": config == LOGITS_CONFIG}
            try:
                row["ms"] = time_graph(call, ROUTER_COPIES, GRAPH_CALLS, max(3, repeats // 10))
            except Exception as exc:
                row["failed"] = repr(exc)[:300]
                print(json.dumps(row), flush=True)
                continue
            print(json.dumps(row), flush=True)
            if best is None or row["ms"] < best["ms"]:
                best = row
        print(json.dumps({**best, "bench": "kernels.router.best"}), flush=True)


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


# tiles tried, K steps of STEP: (pairs, rows, warps, stages, register cap or None); the bf16 path's too,
# capped (its 64 x 64 tile takes 232 registers a thread: 2 programs an SM)
FP8_TILES = ((64, 64, 4, 3, None), (64, 64, 4, 3, 168), (64, 64, 4, 3, 128), (64, 64, 4, 4, 128),
             (128, 128, 8, 4, None), (128, 128, 8, 4, 168), (128, 128, 8, 3, 128), (64, 128, 4, 3, 128))
BF16_TILES = ((64, 64, 4, 3, 168), (64, 64, 4, 3, 128), (128, 128, 8, 4, 168), (128, 128, 8, 4, 128))


def bench_moe_mxfp4_fp8(repeats: int) -> None:
    generator = torch.Generator("cuda").manual_seed(3)
    experts_total, dim, inter, top_k = 256, 4096, 2048, 6
    released = _mxfp4_layer(generator, experts_total, dim, inter)
    gate_up, down = (from_released(w.codes, w.scales) for w in released)
    del released
    torch.cuda.empty_cache()
    for tokens in (2048, 4096, 8192):
        x = torch.randn(tokens, dim, device="cuda", generator=generator).bfloat16()
        experts = torch.rand(tokens, experts_total, device="cuda", generator=generator).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device="cuda", generator=generator)
        args = (x, weights, experts, gate_up, down, 0, 10.0, False)
        flops = 2 * tokens * top_k * 3 * dim * inter
        want = experts_sorted(*args)
        runs = [("sorted_bf16", None, lambda: experts_sorted(*args))]
        for path, run, tiles in (("sorted_bf16", experts_sorted, BF16_TILES), ("sorted_fp8", experts_sorted_fp8, FP8_TILES)):
            for m, n, warps, stages, registers in tiles:
                tile = Tile(m, n, STEP, warps, stages, registers)
                blocks = {"gate_up": tile, "down": tile}
                runs.append((path, tile, lambda blocks=blocks, run=run: run(*args, blocks=blocks)))
        for name, tile, fn in runs:
            try:
                got = fn()
                error = float((got - want).norm() / want.norm())
                ms = median_ms(fn, 10)
            except Exception as exc:  # a tile the compiler refuses: reported, the sweep goes on
                print(json.dumps({"bench": "kernels.moe_mxfp4_fp8", "path": name, "tokens": tokens, "tile": tile,
                                  "failed": repr(exc)[:300]}), flush=True)
                continue
            print(json.dumps({"bench": "kernels.moe_mxfp4_fp8", "path": name, "tokens": tokens, "tile": tile,
                              "ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_bf16": error}), flush=True)


BENCHES = {"moe": (bench_moe, sweep_pairwise_blocks), "moe_mxfp4": (bench_moe_mxfp4,),
           "moe_mxfp4_fp8": (bench_moe_mxfp4_fp8,),
           "mxfp4_decode": (sweep_mxfp4_decode,), "router": (sweep_router,), "attention": (bench_attention,)}


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
