"""Long-context decode with V4.1's packed KV in the host tier (`offload.kv: host_packed`): tokens/s at
32K and 128K context with and without the tier, bytes per token per tier, and the check that the tier
changes nothing (JSON lines).

    python -m bench.long_context [--config configs/models/DeepSeek-V4.1-Flash/config.json] [--layers 3]
                                 [--context 32768 131072] [--concurrency 1 8] [--steps 32] [--check-steps 8]
                                 [--hot-tokens 32768] [--prefill-chunk 512] [--block-tokens 128] [--device cuda]
                                 [--dtype bfloat16] [--caches plain packed tiered]

The model is the first --layers layers of a V4.1 config with random weights built in device memory
(bench/slice.py's rule; Engram and the MTP layers left out, sources past the slice dropped): the
Flash config's first 3 layers hold one kv + index source (ratio 2, top-512). A random model cannot
retrieve a planted needle, so at each context the same prompt runs through three caches: plain (the
model dtype), packed FP4 on the device, packed FP4 in the host tier with a --hot-tokens GPU ring.
For each, slot 0 is prefilled in --prefill-chunk chunks (the last chunk's top-k ids recorded), then
--check-steps decode steps feed the same seeded tokens (each step's logits recorded), then slot 0 is
copied to the other slots and decode is timed per concurrency (bench.slice's decode_steps: CUDA
graphs on the GPU). Lines:
- `long_context.check`: per context, whether the packed and tiered caches picked the same top-k ids as
  the plain cache for every query of the last prefill chunk, and gave bitwise the same decode logits
  (and the largest difference);
- `long_context.prefill`: per (cache, context) the prompt's prefill time from the first chunk's launch
  to the last chunk's end (TTFT less the first token's draw) and its tokens/s;
- `long_context.decode`: per (cache, context, concurrency) step p50 / p90 ms and tokens/s, the cache's
  bytes per token on the device and in the host tier, pages copied into the ring, and for the tiered
  cache its tokens/s over the packed cache's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.decode import chunk
from bench.slice import copy_slot_to_all, decode_steps, random_tokens, run_fields, synchronize
from contract import StepPlan
from models import ForwardBatch, ModelConfig
from models.attention_v41 import SelectionTrace
from models.random_model import build_random_model
from worker import ModelRunner

FLASH_V41 = Path(__file__).resolve().parent.parent / "configs/models/DeepSeek-V4.1-Flash/config.json"
CACHES = {"plain": ("auto", None), "packed": ("fp4", None), "tiered": ("fp4", "hot")}


def v41_slice_config(path: Path, layers: int) -> dict[str, Any]:
    """The text config of a V4.1 config.json cut to its first `layers` layers, without Engram, MTP /
    dspark layers or quantization; sources past the cut are dropped."""
    raw = json.loads(path.read_text())
    text = dict(raw.get("text_config", raw))
    if layers > text["num_hidden_layers"]:
        raise SystemExit(f"{path} has {text['num_hidden_layers']} layers; --layers {layers} asks for more")
    text.update(model_type="deepseek_v41_text", num_hidden_layers=layers, num_nextn_predict_layers=0,
                compress_ratios=text["compress_ratios"][:layers], engram_layer_ids=[], engram_num_embeddings=[])
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        text[key] = [i for i in text[key] if i < layers]
    if (text.get("candidate_source_layer_id") or 0) >= layers:
        text["candidate_source_layer_id"] = None
    for key in [k for k in text if k.startswith("dspark_")] + ["quantization_config"]:
        text.pop(key, None)
    if not text["kv_source_layer_ids"]:
        raise SystemExit(f"the first {layers} layers of {path} hold no kv source: nothing would be packed")
    return text


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = ModelConfig.from_dict(v41_slice_config(Path(args.config), args.layers))
    return build_random_model(config, getattr(torch, args.dtype), args.device, args.seed)


def per_token_bytes(runner: ModelRunner) -> dict[str, float]:
    cache = runner.cache
    host = cache.host_tier_page_bytes()
    return {"device_bytes_per_token": (cache.page_bytes() - host) / cache.block_tokens,
            "host_bytes_per_token": host / cache.block_tokens}


def prefill_traced(runner: ModelRunner, tokens: list[int], chunk_tokens: int) -> list[torch.Tensor]:
    """Slot 0 from position 0 in chunks, as the engine's chunked prefill (ring held before each chunk);
    the last chunk's top-k ids of every index source layer."""
    trace = SelectionTrace()
    for start in range(0, len(tokens), chunk_tokens):
        piece = tokens[start : start + chunk_tokens]
        pages = chunk(runner, 0, piece, start).pages
        runner.cache.hold_hot([(pages, start + len(piece))])
        last = start + chunk_tokens >= len(tokens)
        runner.model(ForwardBatch.build([(0, piece, start, list(pages))]), runner.cache, trace=trace if last else None)
    return [ids.cpu() for _, per_layer in sorted(trace.topk.items()) for ids in per_layer if ids is not None]


def check_decode(runner: ModelRunner, position: int, tokens: list[int]) -> torch.Tensor:
    """Decode steps of slot 0 through the runner (graph replays on the GPU), fed `tokens`: each step's
    logits, read from the slot's kept last logits."""
    rows = []
    for step, token in enumerate(tokens):
        runner.execute(StepPlan((chunk(runner, 0, [token], position + step),)))
        rows.append(runner.last_logits[0].float().cpu())
    return torch.stack(rows)


def run(args: argparse.Namespace) -> None:
    fields = {**run_fields(args), "bench_config": str(args.config)}
    model = build_model(args)
    vocab, most = model.config.vocab_size, max(args.concurrency)
    for context in args.context:
        generator = torch.Generator().manual_seed(args.seed + context)
        prompt = random_tokens(generator, vocab, context)
        check_tokens = random_tokens(generator, vocab, args.check_steps)
        seen: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}
        speed: dict[tuple[str, int], float] = {}
        max_len = context + args.check_steps + len(args.concurrency) * (args.steps + 2) + 1
        for name in args.caches:
            kv_dtype, tier = CACHES[name]
            runner = ModelRunner(model, most, max_len, device=args.device, cuda_graphs=args.device == "cuda",
                                 kv_cache_dtype=kv_dtype, kv_hot_tokens=args.hot_tokens if tier else None,
                                 snapshot_slots=1, block_tokens=args.block_tokens)
            synchronize(args.device)
            start = time.perf_counter()
            topk = prefill_traced(runner, prompt, args.prefill_chunk)
            synchronize(args.device)
            seconds = time.perf_counter() - start
            print(json.dumps({"bench": "long_context.prefill", "cache": name, "context": context,
                              "prefill_chunk": args.prefill_chunk, "hot_tokens": args.hot_tokens if tier else None,
                              "prefill_s": seconds, "prefill_tokens_per_s": context / seconds, **fields}), flush=True)
            seen[name] = (topk, check_decode(runner, context, check_tokens))
            copy_slot_to_all(runner, most)
            for concurrency in args.concurrency:
                positions = [context + args.check_steps] * most
                measured = decode_steps(runner, positions, concurrency, args.steps, args.row_budget_s, generator)
                measured.pop("experts_touched"), measured.pop("contexts")
                speed[name, concurrency] = measured["tokens_per_s"]
                row = {"bench": "long_context.decode", "cache": name, "context": context, "concurrency": concurrency,
                       "hot_tokens": args.hot_tokens if tier else None, **measured, **per_token_bytes(runner),
                       "ring_pages_filled": runner.cache.hot.filled_pages if runner.cache.hot else 0}
                if name == "tiered" and ("packed", concurrency) in speed:
                    row["tokens_per_s_over_packed"] = measured["tokens_per_s"] / speed["packed", concurrency]
                print(json.dumps({**row, **fields}), flush=True)
            del runner
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if "plain" not in seen:
            continue
        plain_topk, plain_logits = seen["plain"]
        for name in [name for name in ("packed", "tiered") if name in seen]:
            topk, logits = seen[name]
            print(json.dumps({
                "bench": "long_context.check", "cache": name, "context": context, "hot_tokens": args.hot_tokens,
                "topk_layers": len(topk), "topk_queries": int(sum(ids.shape[0] for ids in topk)),
                "topk_equal": len(topk) == len(plain_topk) and all(torch.equal(a, b) for a, b in zip(topk, plain_topk)),
                "logits_equal": torch.equal(logits, plain_logits),
                "logits_max_abs_diff": float((logits - plain_logits).abs().max()),
                "tokens_equal": torch.equal(logits.argmax(-1), plain_logits.argmax(-1)), **fields,
            }), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(FLASH_V41))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--check-steps", type=int, default=8)
    parser.add_argument("--row-budget-s", type=float, default=20.0)
    parser.add_argument("--hot-tokens", type=int, default=32768)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per KV page (scheduler.block_tokens)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES),
                        help="which caches run (the check lines need plain beside packed / tiered)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
