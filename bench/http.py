"""Decode through the HTTP API: concurrent streamed completions with the official `openai` client,
against a server this command starts (`python -m server ARGS`) or one already running (`--url`).

    python -m bench.http [--server-args "--config configs/h200x1.yaml"] [--url http://HOST:PORT/v1]
                         [--concurrency 1 8 32] [--prompt-len 16 8192] [--max-tokens 64] [--model NAME]
                         [--vocab 256]

For each (prompt length, concurrency) it sends that many requests at once. Each request is a prompt of
random token ids from [10, --vocab), greedy, `ignore_eos`, `max_tokens`. One JSON line per pair:
- `tokens_per_s`: generated tokens of all requests over the time from the first request sent to the
  last token received;
- `decode_tokens_per_s`: tokens after each request's first, over the span from the last first token
  to the last token (all requests decoding together);
- `ttft_ms_p50` / `ttft_ms_max` and `itl_ms_p50` / `itl_ms_p90`: inter-token gaps of streamed chunks.

The figures are the whole server's: HTTP, JSON, SSE, the engine process and IPC, next to
`bench.slice decode`'s runner-only figures for the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Timing:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per streamed chunk that carried tokens
    tokens: int = 0


async def one_request(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> Timing:
    timing = Timing(sent=time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            timing.arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    return timing


async def measure(client: AsyncOpenAI, model: str, concurrency: int, prompt_len: int, max_tokens: int,
                  vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    began = time.perf_counter()
    timings = await asyncio.gather(*(one_request(client, model, p, max_tokens) for p in prompts))
    first = [t.arrivals[0] for t in timings if t.arrivals]
    last = max(t.arrivals[-1] for t in timings if t.arrivals)
    gaps = [b - a for t in timings for a, b in zip(t.arrivals, t.arrivals[1:])]
    generated = sum(t.tokens for t in timings)
    decode_span = last - max(first)
    ttft = [1000 * (t.arrivals[0] - t.sent) for t in timings if t.arrivals]
    return {
        "bench": "http.decode", "concurrency": concurrency, "prompt_len": prompt_len, "max_tokens": max_tokens,
        "generated": generated, "tokens_per_s": generated / (last - began),
        "decode_tokens_per_s": (generated - len(first)) / decode_span if decode_span > 0 else None,
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_max": max(ttft),
        "itl_ms_p50": 1000 * statistics.median(gaps) if gaps else None,
        "itl_ms_p90": 1000 * statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else None,
    }


@contextmanager
def served(server_args: list[str], port: int, timeout_s: float) -> Iterator[str]:
    """`python -m server ARGS --port PORT` until /ready answers; its /v1 base URL. Stopped after."""
    process = subprocess.Popen([sys.executable, "-m", "server", *server_args, "--port", str(port)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode} before it was ready")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")
            time.sleep(0.5)
        yield f"{base}/v1"
    finally:
        process.terminate()
        process.wait(timeout=60)


async def run_all(args: argparse.Namespace, url: str) -> None:
    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("DS4SERVE_API_KEY", "none"), max_retries=0, timeout=600)
    listed = await client.models.list()
    model = args.model or listed.data[0].id
    vocab = args.vocab
    await measure(client, model, 1, 4, 2, vocab, seed=0)  # warm-up: first-call costs out of the figures
    for prompt_len in args.prompt_len:
        for concurrency in args.concurrency:
            row = await measure(client, model, concurrency, prompt_len, args.max_tokens, vocab, seed=concurrency)
            print(json.dumps({**row, "model": model, "url": url}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server's /v1 base URL (default: start one)")
    parser.add_argument("--server-args", default="", help="arguments of `python -m server` (default: the tiny model)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[16, 8192])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", help="served model name (default: the first /v1/models lists)")
    parser.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [10, vocab)")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.url:
        asyncio.run(run_all(args, args.url))
        return
    with served(shlex.split(args.server_args), args.port, args.ready_timeout_s) as url:
        asyncio.run(run_all(args, url))


if __name__ == "__main__":
    main()
