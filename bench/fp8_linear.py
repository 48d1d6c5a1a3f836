# ruff: noqa: B023  (each path's lambda runs inside its own iteration)
"""FP8 block-scaled linears at V4-Flash / V4.1-Flash projection shapes, every GPU path side by side in
one run (JSON lines), so the dispatch threshold in kernels/fp8_linear.py is a measured choice.

    python -m bench.fp8_linear [--m 1 8 32 256 2048 8192] [--blocks 128 32] [--replays 5] [--configs]
                               [--paths splitk splitk_config ...]

Shapes (N, K): V4-Flash (128 x 128 blocks) q_a 1024x4096, q_b 32768x1024, o_b 4096x8192, shared-expert
gate/up 2048x4096; V4.1-Flash (32 x 32 blocks) q_b 32768x1280, o_b 5120x8192, shared gate/up 2304x5120.
Weights: random, quantized with power-of-two (UE8M0) block scales as released; x random bf16 (fresh
per shape, never zeros). Paths:
- splitk: `fp8_linear_triton`, today's decode kernel (its DECODE_CONFIGS row for the block and M).
- splitk_sum_kernel: the same with the K shares added by a second kernel (not by the tile's last share).
- splitk_config: the same kernel per `SPLITK_CONFIGS` row (--configs, M <= 32); the summary names the best.
- reference: `fp8_linear_reference` (dequantize W, bf16 F.linear): today's path for M > 256.
- cublas_bf16: F.linear on a W dequantized ahead of time (cuBLAS bf16 ceiling, no dequant cost).
- tc: `fp8_linear_tc` (Triton, W decoded in registers, bf16 tensor cores), per tile config.
- w8a8: `fp8_linear_w8a8` (x to e4m3 per 1 x block group, fp8 tensor cores), per tile config.
- dequant_cublas: `fp8_linear_dequant` (one Triton pass W -> bf16, then F.linear); dequant_only its pass.
- dispatch: `fp8_linear` as the model calls it.
- scaled_mm: `fp8_linear_scaled_mm`, torch's blockwise scaled matmul (1 x 128 activations, 128 x 128 weights; sm90, CUDA >=
  12.9), x's quantization included; 128 blocks only (torch has no 32 x 32 recipe on sm90).
Each row: median ms per call over CUDA-graph replays (each graph cycles through enough weight copies
to exceed the 60 MB L2, so decode rows read W from memory), TFLOP/s (2MNK), bytes/s (W fp8 + scales +
x + out, each once) and its share of the device-to-device copy bandwidth measured first in the same
run, and rel_err = ||y - y64|| / ||y64|| against float64 on the same bf16 x and the exact dequantized W.

On the lent H200 (carry .whl; ~3-5 min):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; python3 -m bench.fp8_linear --configs 2>&1 | tee $OUT/fp8_linear.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

from bench.slice_roofline import copy_bandwidth, matmul_ceiling
from kernels.fp8_linear import (
    TC_CONFIG,
    W8A8_CONFIG,
    DecodeConfig,
    decode_config,
    dequantize_fp8_blocks_triton,
    fp8_linear,
    fp8_linear_dequant,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    fp8_linear_tc,
    fp8_linear_triton,
    fp8_linear_w8a8,
    quantize_fp8_groups,
)

SHAPES = {
    128: [("q_a", 1024, 4096), ("q_b", 32768, 1024), ("o_b", 4096, 8192), ("shared_gate_up", 2048, 4096)],
    32: [("v41_q_b", 32768, 1280), ("v41_o_b", 5120, 8192), ("v41_shared_gate_up", 2304, 5120)],
}
TC_CONFIGS = [TC_CONFIG, (64, 128, 128, 4, 3), (128, 256, 64, 8, 3)]
W8A8_CONFIGS = [W8A8_CONFIG, (128, 256, 128, 8, 3)]
# the split-K decode kernel's configs swept at M <= 32 under --configs (kernels/fp8_linear.DECODE_CONFIGS
# takes the best): output columns, K step, programs aimed at, warps, stages; per scale block
SPLITK_CONFIGS = {
    128: [DecodeConfig(*c) for c in ((32, 128, 264, 4, 3), (64, 128, 264, 4, 3), (32, 256, 264, 4, 3),
                                     (32, 128, 528, 4, 3), (64, 256, 528, 4, 3), (32, 128, 264, 4, 4),
                                     (64, 128, 528, 4, 4), (128, 128, 264, 4, 3))],
    32: [DecodeConfig(*c) for c in ((32, 32, 264, 4, 3), (32, 64, 264, 4, 3), (32, 128, 264, 4, 3),
                                    (64, 128, 264, 4, 3), (32, 128, 528, 4, 3), (64, 256, 528, 4, 3),
                                    (64, 128, 528, 4, 4))],
}
L2_BYTES = 60 << 20


def ue8m0_weight(n: int, k: int, block: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random W as released: e4m3 values, power-of-two scale per block (amax / 448 rounded up)."""
    w = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    blocks = w.view(n // block, block, k // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    values = (blocks / scale[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    return values, scale


def exact_dequant(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return values.double() * scale.double().repeat_interleave(block, 0).repeat_interleave(block, 1)


def time_graph(make_call, sets: int, calls: int, replays: int) -> float:
    """Median ms per call: a CUDA graph of `calls` calls cycling through `sets` input sets."""
    for i in range(3):
        make_call(i % sets)()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            make_call(i % sets)()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 256, 2048, 8192])
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--configs", action="store_true", help="sweep the tile configs (else the defaults only)")
    parser.add_argument("--paths", nargs="+", default=None, help="only these paths (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    props = torch.cuda.get_device_properties(0)
    print(json.dumps({"bench": "fp8_linear.device", "name": props.name, "sms": props.multi_processor_count,
                      "torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
    copy = copy_bandwidth("cuda", 4 << 30)
    print(json.dumps(copy), flush=True)
    ceiling = matmul_ceiling("cuda", 8192, torch.bfloat16)
    print(json.dumps(ceiling), flush=True)
    copy_bps, mm_flops = copy["bytes_per_s"], ceiling["flops_per_s"]
    scaled_name = "scaled_mm"

    generator = torch.Generator("cuda").manual_seed(args.seed)
    rows: list[dict] = []
    for block in args.blocks:
        for shape, n, k in SHAPES[block]:
            w_bytes = n * k + (n // block) * (k // block) * 4
            sets = max(1, min(32, math.ceil(2 * L2_BYTES / w_bytes)))
            weights = [ue8m0_weight(n, k, block, generator) for _ in range(sets)]
            dense_sets = max(1, min(16, math.ceil(L2_BYTES / (n * k))))
            dense = [exact_dequant(w, s, block).to(torch.bfloat16) for w, s in weights[:dense_sets]]  # exact: UE8M0
            w64 = exact_dequant(*weights[0], block)
            for m in args.m:
                x = torch.randn(m, k, device="cuda", generator=generator).bfloat16()
                truth = x.double() @ w64.t()
                calls = 20 if m <= 256 else 3
                paths = [("splitk", tuple(decode_config(block, m)), lambda w, s: fp8_linear_triton(x, w, s, block)),
                         ("splitk_sum_kernel", tuple(decode_config(block, m)),
                          lambda w, s: fp8_linear_triton(x, w, s, block, last_sums=False)),
                         ("reference", None, lambda w, s: fp8_linear_reference(x, w, s, block)),
                         ("dispatch", None, lambda w, s: fp8_linear(x, w, s, block))]
                for config in (SPLITK_CONFIGS[block] if args.configs and m <= 32 else []):
                    paths.append(("splitk_config", tuple(config),
                                  lambda w, s, c=config: fp8_linear_triton(x, w, s, block, c)))
                for config in (TC_CONFIGS if args.configs else [TC_CONFIG]):
                    paths.append(("tc", config, lambda w, s, c=config: fp8_linear_tc(x, w, s, block, c)))
                for config in (W8A8_CONFIGS if args.configs else [W8A8_CONFIG]):
                    paths.append(("w8a8", config, lambda w, s, c=config: fp8_linear_w8a8(x, w, s, block, c)))
                paths.append(("dequant_cublas", None, lambda w, s: fp8_linear_dequant(x, w, s, block)))
                paths.append(("dequant_only", None, lambda w, s: dequantize_fp8_blocks_triton(w, s, block)))
                if block == 128:
                    paths.append((scaled_name, None, lambda w, s: fp8_linear_scaled_mm(x, w, s, block)))
                    paths.append(("quantize_x_only", None, lambda w, s: quantize_fp8_groups(x, 128)))
                paths.append(("cublas_bf16", None, "dense"))
                for name, config, fn in [p for p in paths if args.paths is None or p[0] in args.paths]:
                    row = {"bench": "fp8_linear", "block": block, "shape": shape, "n": n, "k": k, "m": m,
                           "path": name, "config": config}
                    try:
                        if fn == "dense":
                            y = F.linear(x, dense[0])
                            ms = time_graph(lambda i: (lambda: F.linear(x, dense[i % len(dense)])), len(dense), calls, args.replays)
                        else:
                            y = fn(*weights[0])
                            ms = time_graph(lambda i: (lambda: fn(*weights[i])), sets, calls, args.replays)
                        if name not in ("quantize_x_only", "dequant_only"):
                            y64 = y.double()
                            row["rel_err"] = float((y64 - truth).norm() / truth.norm())
                            row["finite"] = bool(torch.isfinite(y).all())
                        nbytes = w_bytes + m * k * 2 + m * n * 2
                        row.update(ms=ms, tflops=2 * m * n * k / (ms * 1e-3) / 1e12, bytes_per_s=nbytes / (ms * 1e-3),
                                   of_copy_bw=nbytes / (ms * 1e-3) / copy_bps, of_bf16_mm=2 * m * n * k / (ms * 1e-3) / mm_flops)
                    except Exception as error:  # noqa: BLE001 - a path that cannot run is a row too
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                del truth
            weights = dense = w64 = None
            torch.cuda.empty_cache()
    summary(rows)


def summary(rows: list[dict]) -> None:
    """The fastest config of each path per (block, shape, M): ms (rel_err x 1e3) per path."""
    names = ["splitk", "splitk_sum_kernel", "splitk_config", "dispatch", "dequant_cublas", "reference", "tc", "w8a8", "scaled_mm", "cublas_bf16", "dequant_only"]
    print("block shape m | " + " | ".join(names) + "   (ms, rel_err x 1e3)")
    keys = sorted({(r["block"], r["shape"], r["m"]) for r in rows}, key=lambda t: (-t[0], t[1], t[2]))
    for key in keys:
        cells = []
        for name in names:
            got = [r for r in rows if (r["block"], r["shape"], r["m"]) == key and r["path"] == name and "ms" in r]
            if not got:
                cells.append("-")
                continue
            best = min(got, key=lambda r: r["ms"])
            cell = f"{best['ms']:.4f} ({1e3 * best.get('rel_err', 0):.1f})"
            cells.append(cell + (f" {best['config']}" if name == "splitk_config" else ""))
        print(f"{key[0]} {key[1]} {key[2]} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
