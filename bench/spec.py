"""Speculative decoding served (issue 27): plain decoding beside a proposer at each K, through HTTP, in
one run, with the acceptance the server counted.

    python -m bench.spec --model DIR [--method mtp|ngram|dspark] [--k 1 2 3 4] [--concurrency 1 8]
                         [--max-tokens 128] [--prompt-chars 1500] [--prompts held-out|random]
                         [--adaptive] [--draft-model DIR] [--server-args "..."] [--port 8013]

For each configuration (plain, then --method with K = each --k; fixed K as vLLM's
`num_speculative_tokens`, or the engine's adaptive policy with --adaptive) it starts `python -m server
--model DIR [--speculative-config ...] SERVER_ARGS`, and for each concurrency sends that many greedy
streamed completions at once (ignore_eos, --max-tokens each), measured as `bench.http` measures. The
prompts are real text the default model never trained on: the start (--prompt-chars characters) of the
Python standard library's held-out modules (tools/stdlib_corpus.py; random token ids inflate the
acceptance of an untrained draft and deflate a trained one's). From vLLM's counters on /metrics, read
before and after each cell once the engine's stats have settled:
- `acceptance_length`: tokens a verify step yields on average, 1 + accepted drafts / verify steps (the
  figure DSpark / MTP reports quote; 1.0 when nothing is accepted);
- `accepted_per_position`: the share of verify steps whose draft at each position was accepted;
- `speedup`: decode tokens/s over plain decoding's at the same concurrency in this run.
One JSON line per (configuration, concurrency), `bench: spec`, with machine and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.http import served, timed_decode
from bench.served import git_commit
from tools.stdlib_corpus import split, stdlib_files

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def held_out_prompts(count: int, chars: int) -> list[str]:
    """The first `chars` characters of `count` held-out stdlib modules (the longest first: each fills them)."""
    _, held_out = split(stdlib_files())
    texts = sorted((f.text() for f in held_out), key=len, reverse=True)
    return [text[:chars] for text in texts[:count]]


def spec_counters(base: str) -> dict[str, float]:
    """vLLM's spec-decode counters on /metrics (summed over label sets), per-position ones keyed
    `PER_POSITION/<position>`."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in COUNTERS:
                totals[name] = totals.get(name, 0.0) + sample.value
            elif name == PER_POSITION:
                key = f"{PER_POSITION}/{sample.labels['position']}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def settled_counters(base: str, changed_from: dict[str, float] | None = None,
                     timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once two reads a stats interval apart agree (the engine sends its stats every second)
    and, with `changed_from`, differ from it (the cell's steps were counted: a loaded machine may send
    them late)."""
    last, deadline = spec_counters(base), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = spec_counters(base)
        if now == last and (changed_from is None or now != changed_from):
            return now
        last = now
    return last


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict:
    """acceptance_length, accepted_per_position and the raw counts between two counter reads."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    steps = delta.get("vllm:spec_decode_num_drafts", 0.0)
    positions = sorted(int(key.rpartition("/")[2]) for key in delta if key.startswith(PER_POSITION + "/"))
    return {
        "verify_steps": steps,
        "draft_tokens": delta.get("vllm:spec_decode_num_draft_tokens", 0.0),
        "accepted_tokens": delta.get("vllm:spec_decode_num_accepted_tokens", 0.0),
        "acceptance_length": 1 + delta.get("vllm:spec_decode_num_accepted_tokens", 0.0) / steps if steps else None,
        "accepted_per_position": [delta[f"{PER_POSITION}/{p}"] / steps for p in positions] if steps else [],
    }


def machine() -> str:
    """The GPU the server runs on (this host's first), else this host's processor."""
    import platform

    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()


def speculative_config(method: str, k: int, adaptive: bool, draft_model: str | None) -> str:
    config = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    if draft_model:
        config["model"] = draft_model
    return json.dumps(config)


async def cells(url: str, concurrencies: list[int], prompts: list[str], max_tokens: int,
                speculating: bool) -> list[dict]:
    """One measured cell per concurrency on the server at `url` (a short warm-up first)."""
    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("DS4SERVE_API_KEY", "none"), max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await timed_decode(client, model, prompts[:1], 4)  # first-call costs out of the figures
    base = url.removesuffix("/v1")
    rows = []
    for concurrency in concurrencies:
        before = settled_counters(base)
        row = await timed_decode(client, model, [prompts[i % len(prompts)] for i in range(concurrency)], max_tokens)
        after = settled_counters(base, changed_from=before) if speculating else before
        rows.append({"concurrency": concurrency, **row, **acceptance(before, after)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the checkpoint directory served")
    parser.add_argument("--method", default="mtp", choices=("mtp", "ngram", "dspark"))
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-chars", type=int, default=1500)
    parser.add_argument("--prompts", choices=("held-out", "random"), default="held-out",
                        help="held-out stdlib text, or random printable text (what inflates an untrained draft)")
    parser.add_argument("--adaptive", action="store_true", help="the engine's adaptive K instead of a fixed K")
    parser.add_argument("--draft-model", help="dspark: the draft checkpoint (default: --model)")
    parser.add_argument("--server-args", default="", help="more arguments of `python -m server`")
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    count = max(args.concurrency)
    if args.prompts == "held-out":
        prompts = held_out_prompts(count, args.prompt_chars)
    else:
        import random

        rng = random.Random(0)
        prompts = ["".join(chr(rng.randrange(32, 127)) for _ in range(args.prompt_chars)) for _ in range(count)]
    stamp = {"machine": machine(), "commit": git_commit()}
    plain: dict[int, float] = {}
    configurations = [("plain", 0)] + [(args.method, k) for k in args.k]
    for method, k in configurations:
        server_args = ["--model", args.model, *shlex.split(args.server_args)]
        if k:
            draft = args.draft_model or (args.model if method == "dspark" else None)
            server_args += ["--speculative-config", speculative_config(method, k, args.adaptive, draft)]
        with served(server_args, args.port, args.ready_timeout_s) as (url, _):
            rows = asyncio.run(cells(url, args.concurrency, prompts, args.max_tokens, speculating=bool(k)))
        for row in rows:
            speed = row["decode_tokens_per_s"] or row["tokens_per_s"]
            if not k:
                plain[row["concurrency"]] = speed
            baseline = plain.get(row["concurrency"])
            print(json.dumps({"bench": "spec", "method": method, "k": k, "adaptive": args.adaptive if k else None,
                              "prompts": args.prompts, "model": args.model, **row,
                              "speedup": speed / baseline if baseline else None, **stamp}), flush=True)


if __name__ == "__main__":
    main()
