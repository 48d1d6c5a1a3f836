"""Prefix-cache follow-ups: a 5-turn chat over an ~8K-token history, through HTTP (JSON lines out).

    python -m bench.prefix [--history-tokens 8192] [--turns 5] [--answer-tokens 32] [--repeats 3]
                           [--thinking on off]

Starts `python -m server` on a tiny V4.1 checkpoint built for long contexts, then runs a chat whose
first user turn is a document of `--history-tokens` tokens; every later turn resends the whole
conversation (earlier answers included, their reasoning dropped as the chat format says) plus a short
question. TTFT is the time to the first streamed token. Each turn is also sent cold, under a fresh
`cache_salt` (a tenant with an empty cache), so the follow-up is compared with a cold prefill of the
same prompt in the same run. Lines:
  {"bench": "prefix", "thinking", "turn", "prompt_tokens", "cached_tokens", "ttft_ms", "cold_ttft_ms",
   "ttft_ratio"}  (medians over the repeats; ratio = ttft / cold ttft)
  {"bench": "prefix_summary", "thinking", "hit_rate" (cached / prompt tokens over turns 2..N),
   "turn1_ttft_ms", "followup_ttft_ratio_max", "machine", "commit"}
Goal (issue 7): every follow-up's TTFT <= 10% of the cold prefill of its prompt.

    python -m bench.prefix --state-costs

prints what decided the design of scheduler/prefix_cache.py (state points where requests diverge,
not a snapshot at every page): per model, the bytes of one slot's fixed state (what a snapshot
copies) against the bytes of one page of KV, from config.json alone (the cache is allocated on the
meta device), and for the tiny model on this machine the time to copy a snapshot against the time to
compute one page of tokens. Lines: {"bench": "prefix_state", "model", "snapshot_bytes",
"page_bytes", "block_tokens", "snapshot_over_page", "copy_ms", "compute_page_ms"}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import openai
import torch

from models import ModelCache, ModelConfig, load_model
from models.tiny import CORPUS, build_tiny_checkpoint
from tests.serving import running_server

QUESTIONS = ["What is the main point?", "Say more about the server.", "And the attention?", "Summarise it all."]


def document(server: str, tokens: int) -> str:
    """Corpus sentences, numbered so that no two repeat, cut to about `tokens` tokens."""
    sentences, text = itertools.cycle(CORPUS), ""
    while True:
        for k in range(64):
            text += f"[{len(text)}] {next(sentences)} "
        count = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]
        if count >= tokens:
            return text[: int(len(text) * tokens / count)]


def first_token(client: openai.OpenAI, messages: list[dict], extra: dict, max_tokens: int) -> tuple[float, str, object]:
    """(TTFT in seconds, the answer text, usage) of one streamed chat completion."""
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.content or "") + (delta.model_extra.get("reasoning_content") or "")
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text += delta.content or ""
    return ttft, text, usage


def conversation(client: openai.OpenAI, doc: str, args: argparse.Namespace, thinking: bool) -> list[dict]:
    """One chat of `args.turns` turns; per turn the warm and the cold TTFT."""
    extra = {"chat_template_kwargs": {"thinking": thinking}, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    messages: list[dict] = [{"role": "user", "content": doc + "\n\nWhat is this document about?"}]
    rows = []
    for turn in range(1, args.turns + 1):
        cold_extra = extra | {"cache_salt": uuid.uuid4().hex}
        cold_ttft, _, _ = first_token(client, messages, cold_extra, 1)
        ttft, answer, usage = first_token(client, messages, extra, args.answer_tokens)
        rows.append({
            "turn": turn, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "ttft_ms": 1000 * ttft,
            "cold_ttft_ms": 1000 * cold_ttft,
        })
        messages += [{"role": "assistant", "content": answer or "ok"},
                     {"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]}]
    return rows


def state_costs(block_tokens: int = 128) -> None:
    """Snapshot bytes against page bytes per model; copy against compute time for the tiny one."""
    repo = Path(__file__).resolve().parent.parent
    models = {path.parent.name: path for path in sorted((repo / "configs" / "models").glob("*/config.json"))}
    for name, path in models.items():
        config = ModelConfig.from_file(path)
        cache = ModelCache.allocate(config, 1, block_tokens, dtype=torch.bfloat16, device="meta", num_pages=1,
                                    block_tokens=block_tokens)
        snapshot = sum(t[0].numel() * t.element_size() for t in cache.fixed_tensors())
        print(json.dumps({"bench": "prefix_state", "model": name, "snapshot_bytes": snapshot,
                          "page_bytes": cache.page_bytes(), "block_tokens": block_tokens,
                          "snapshot_over_page": snapshot / cache.page_bytes()}), flush=True)
    with tempfile.TemporaryDirectory(prefix="ds4serve-bench-") as tmp:
        from models.batch import ForwardBatch

        model = load_model(build_tiny_checkpoint(Path(tmp) / "tiny"))
        cache = ModelCache.allocate(model.config, 2, 8 * block_tokens, block_tokens=block_tokens)
        tokens = [7 + (i * 37) % 500 for i in range(4 * block_tokens)]
        model(ForwardBatch.build([(0, tokens[: 3 * block_tokens], 0)]), cache)
        start = time.perf_counter()
        for _ in range(100):
            cache.copy_slots([0], [1])
        copy_ms = 1000 * (time.perf_counter() - start) / 100
        compute = []
        for _ in range(5):
            start = time.perf_counter()
            model(ForwardBatch.build([(1, tokens[3 * block_tokens :], 3 * block_tokens)]), cache)
            compute.append(1000 * (time.perf_counter() - start))
        snapshot = sum(t[0].numel() * t.element_size() for t in cache.fixed_tensors())
        print(json.dumps({"bench": "prefix_state", "model": "tiny (measured, float32, CPU)",
                          "snapshot_bytes": snapshot, "page_bytes": cache.page_bytes(), "block_tokens": block_tokens,
                          "snapshot_over_page": snapshot / cache.page_bytes(), "copy_ms": copy_ms,
                          "compute_page_ms": statistics.median(compute)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history-tokens", type=int, default=8192)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--thinking", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--state-costs", action="store_true", help="print the snapshot / page figures only")
    args = parser.parse_args()
    if args.state_costs:
        state_costs()
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = platform.processor() or platform.machine()
    max_len = args.history_tokens + args.turns * (args.answer_tokens + 64) + 1024
    with tempfile.TemporaryDirectory(prefix="ds4serve-bench-") as tmp:
        model_dir = build_tiny_checkpoint(Path(tmp) / "tiny-long", max_position_embeddings=2 * max_len)
        with running_server(model_dir, "tiny", "--max-model-len", str(max_len)) as server:
            client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=600)
            doc = document(server, args.history_tokens)
            for mode in args.thinking:
                runs = [conversation(client, doc, args, mode == "on") for _ in range(args.repeats)]
                turns = []
                for turn_rows in zip(*runs, strict=True):
                    row = {key: statistics.median(r[key] for r in turn_rows) for key in turn_rows[0]}
                    row["ttft_ratio"] = row["ttft_ms"] / row["cold_ttft_ms"]
                    turns.append(row)
                    print(json.dumps({"bench": "prefix", "thinking": mode, **row}), flush=True)
                follow = turns[1:]
                print(json.dumps({
                    "bench": "prefix_summary", "thinking": mode,
                    "hit_rate": sum(r["cached_tokens"] for r in follow) / sum(r["prompt_tokens"] for r in follow),
                    "turn1_ttft_ms": turns[0]["ttft_ms"],
                    "followup_ttft_ratio_max": max(r["ttft_ratio"] for r in follow),
                    "repeats": args.repeats, "machine": machine, "commit": commit,
                }), flush=True)


if __name__ == "__main__":
    main()
