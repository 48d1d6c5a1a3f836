"""Decode through the HTTP API: concurrent streamed completions with the official `openai` client,
against a server this command starts (`python -m server ARGS`) or one already running (`--url`).

    python -m bench.http [--server-args "--config configs/h200x1.yaml"] [--url http://HOST:PORT/v1]
                         [--concurrency 1 8 32] [--prompt-len 16 8192] [--max-tokens 64] [--model NAME]
                         [--vocab 256] [--api completions|chat] [--temperature 0] [--top-p 1]
                         [--scripted-step-ms MS] [--server-pid PID]
                         [--arrivals N --arrival-prompt-len 2048 --arrival-interval-ms 200 --pure-s 1]

For each (prompt length, concurrency) it sends that many requests at once. Each request is a prompt of
random token ids from [10, --vocab), greedy (or drawn at --temperature / --top-p: a chat client's
default sampling costs the engine more kernels a step than greedy's one), `ignore_eos`, `max_tokens`.
One JSON line per pair:
- `tokens_per_s`: generated tokens of all requests over the time from the first request sent to the
  last token received;
- `decode_tokens_per_s`: tokens after each request's first, over the span from the last first token
  to the last token (all requests decoding together);
- `ttft_ms_p50` / `ttft_ms_max` and `itl_ms_p50` / `itl_ms_p90`: inter-token gaps of streamed chunks;
- `frontend_cpu_us_per_token`: the server process's CPU time (the HTTP front end; the engine process is
  its child and not counted) over the generated tokens, when its pid is known (a server this command
  started, or `--server-pid`; Linux's /proc).

`--arrivals N` measures issue 22's stall instead: --concurrency streams decode (--max-tokens each, set it
high enough to outlast the run), and after --pure-s seconds of pure decode N requests of
--arrival-prompt-len prompt tokens arrive --arrival-interval-ms apart; one `http.arrivals` line per
concurrency compares the streams' inter-token gaps in the two windows (p50 / p90 / max, and the p90
with arrivals over the pure-decode p50, the issue's 1.5x bound) and their mean inter-token time (the
window over the tokens each stream got in it, counted from the streamed token ids: immune to the
client reading several frames at once, which makes the p50 near 0 when the front end is busy).

`--api chat` streams chat completions instead (the chat output parser runs on every delta).
`--scripted-step-ms MS` starts the front end over a scripted engine instead (bench/scripted_engine.py:
a token per request every MS milliseconds at no engine cost): the front end's own ceiling and cost.

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
from typing import Any, AsyncIterable, Callable, Iterator

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Timing:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per streamed chunk that carried tokens
    tokens: int = 0
    counts: list[int] = field(default_factory=list)  # tokens of each arrival, where the stream says (token_ids)


async def read_timed_stream(
    stream: AsyncIterable[Any], timing: Timing, carries_tokens: Callable[[Any], bool]
) -> Timing:
    """Reads a streamed response to its end into `timing`: the arrival time of each chunk whose first
    choice `carries_tokens`, and the completion tokens of the last chunk with usage. Returns `timing`."""
    async for chunk in stream:
        if chunk.choices and carries_tokens(chunk.choices[0]):
            timing.arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    return timing


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for (the defaults: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0


async def one_request(client: AsyncOpenAI, model: str, prompt: list[int] | str, max_tokens: int,
                      sampling: Sampling = Sampling()) -> Timing:
    timing = Timing(sent=time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    return await read_timed_stream(stream, timing, lambda choice: choice.text is not None)


async def one_chat(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                   sampling: Sampling = Sampling()) -> Timing:
    """A chat turn whose message is the prompt ids written out (the chat template tokenizes it)."""
    timing = Timing(sent=time.perf_counter())
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": " ".join(map(str, prompt))}], max_tokens=max_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    return await read_timed_stream(stream, timing, lambda choice: choice.delta is not None)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process `pid` alone (not its children), from /proc; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def measure(client: AsyncOpenAI, model: str, concurrency: int, prompt_len: int, max_tokens: int,
                  vocab: int, seed: int, api: str = "completions", server_pid: int | None = None,
                  sampling: Sampling = Sampling()) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    row = await timed_decode(client, model, prompts, max_tokens, api, server_pid, sampling)
    return {"bench": "http.decode", "api": api, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "concurrency": concurrency, "prompt_len": prompt_len, "max_tokens": max_tokens, **row}


async def timed_decode(client: AsyncOpenAI, model: str, prompts: list[list[int]] | list[str], max_tokens: int,
                       api: str = "completions", server_pid: int | None = None, sampling: Sampling = Sampling()) -> dict:
    """All `prompts` sent at once (ignore_eos, `max_tokens` each, streamed): the figures `measure` reports."""
    request = one_chat if api == "chat" else one_request
    cpu_before = cpu_seconds(server_pid)
    began = time.perf_counter()
    timings = await asyncio.gather(*(request(client, model, p, max_tokens, sampling) for p in prompts))
    cpu_after = cpu_seconds(server_pid)
    first = [t.arrivals[0] for t in timings if t.arrivals]
    last = max(t.arrivals[-1] for t in timings if t.arrivals)
    gaps = [b - a for t in timings for a, b in zip(t.arrivals, t.arrivals[1:])]
    generated = sum(t.tokens for t in timings)
    decode_span = last - max(first)
    ttft = [1000 * (t.arrivals[0] - t.sent) for t in timings if t.arrivals]
    frontend_cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "generated": generated, "tokens_per_s": generated / (last - began),
        "decode_tokens_per_s": (generated - len(first)) / decode_span if decode_span > 0 else None,
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_max": max(ttft),
        "itl_ms_p50": 1000 * statistics.median(gaps) if gaps else None,
        "itl_ms_p90": 1000 * statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else None,
        "frontend_cpu_us_per_token": 1e6 * frontend_cpu / generated if frontend_cpu is not None and generated else None,
    }


async def measure_arrivals(client: AsyncOpenAI, model: str, concurrency: int, max_tokens: int, vocab: int, seed: int,
                           arrivals: int, arrival_prompt_len: int, interval_ms: float, pure_s: float) -> dict:
    """Issue 22 item 3: `concurrency` streams decode (prompt 16, up to `max_tokens`); once every one has
    its first token, `pure_s` seconds of pure decode, then `arrivals` new requests of `arrival_prompt_len`
    prompt tokens (4 output tokens each) sent `interval_ms` apart, while the streams go on. The streams'
    inter-token gaps that end in each window are compared: a scheduler that stalls decodes behind a
    prefill shows it in the arrivals window's p90 and max. The streams are cut (their requests aborted)
    once the last arrival has its tokens."""
    rng = random.Random(seed)
    streams = [Timing(sent=time.perf_counter()) for _ in range(concurrency)]

    async def stream(timing: Timing, prompt: list[int]) -> None:
        response = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in response:
            if chunk.choices and chunk.choices[0].text is not None:
                timing.arrivals.append(time.perf_counter())
                timing.counts.append(len((chunk.choices[0].model_extra or {}).get("token_ids") or ()))

    tasks = [asyncio.create_task(stream(t, [rng.randrange(10, vocab) for _ in range(16)])) for t in streams]
    try:
        while not all(t.arrivals for t in streams):
            if any(task.done() for task in tasks):
                raise RuntimeError("a decoding stream ended before every stream had its first token")
            await asyncio.sleep(0.005)
        pure_start = time.perf_counter()
        await asyncio.sleep(pure_s)
        arrivals_start = time.perf_counter()
        newcomers = []
        for i in range(arrivals):
            prompt = [rng.randrange(10, vocab) for _ in range(arrival_prompt_len)]
            newcomers.append(asyncio.create_task(one_request(client, model, prompt, 4)))
            if i + 1 < arrivals:
                await asyncio.sleep(interval_ms / 1000)
        done = await asyncio.gather(*newcomers)
        arrivals_end = time.perf_counter()
        if any(task.done() for task in tasks):
            raise RuntimeError("a decoding stream reached max_tokens before the arrivals were served: raise --max-tokens")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def gaps(begin: float, end: float) -> list[float]:
        return [1000 * (b - a) for t in streams for a, b in zip(t.arrivals, t.arrivals[1:]) if begin <= b < end]

    def mean_itl(begin: float, end: float) -> float:
        """The window's length over the tokens each stream got in it (mean per stream): the step time
        the streams saw, whatever bursts the client read them in."""
        tokens = sum(n for t in streams for at, n in zip(t.arrivals, t.counts) if begin <= at < end)
        return 1000 * (end - begin) * len(streams) / tokens if tokens else float("inf")

    pure, busy = gaps(pure_start, arrivals_start), gaps(arrivals_start, arrivals_end)
    if len(pure) < 2 or len(busy) < 2:
        raise RuntimeError(f"too few inter-token gaps to compare ({len(pure)} pure, {len(busy)} with arrivals)")
    p90 = lambda values: statistics.quantiles(values, n=10)[-1]  # noqa: E731
    mean_pure, mean_busy = mean_itl(pure_start, arrivals_start), mean_itl(arrivals_start, arrivals_end)
    return {
        "bench": "http.arrivals", "concurrency": concurrency, "arrivals": arrivals,
        "arrival_prompt_len": arrival_prompt_len, "interval_ms": interval_ms,
        "itl_ms_p50_pure": statistics.median(pure), "itl_ms_p90_pure": p90(pure),
        "itl_ms_p50_arrivals": statistics.median(busy), "itl_ms_p90_arrivals": p90(busy), "itl_ms_max_arrivals": max(busy),
        "p90_over_pure_p50": p90(busy) / statistics.median(pure),
        "arrival_ttft_ms_p50": statistics.median(1000 * (t.arrivals[0] - t.sent) for t in done if t.arrivals),
        "gaps": [len(pure), len(busy)],
        "itl_ms_mean_pure": mean_pure, "itl_ms_mean_arrivals": mean_busy, "mean_over_pure_mean": mean_busy / mean_pure,
    }


@contextmanager
def served(server_args: list[str], port: int, timeout_s: float, module: str = "server") -> Iterator[tuple[str, int]]:
    """`python -m MODULE ARGS --port PORT` until /ready answers; its /v1 base URL and pid. Stopped after."""
    process = subprocess.Popen([sys.executable, "-m", module, *server_args, "--port", str(port)], cwd=REPO,
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
        yield f"{base}/v1", process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


async def run_all(args: argparse.Namespace, url: str, server_pid: int | None) -> None:
    client = AsyncOpenAI(base_url=url, api_key=os.environ.get("DS4SERVE_API_KEY", "none"), max_retries=0, timeout=600)
    listed = await client.models.list()
    model = args.model or listed.data[0].id
    vocab = args.vocab
    await measure(client, model, 1, 4, 2, vocab, seed=0, api=args.api)  # warm-up: first-call costs out of the figures
    if args.arrivals:
        for concurrency in args.concurrency:
            row = await measure_arrivals(client, model, concurrency, args.max_tokens, vocab, concurrency, args.arrivals,
                                         args.arrival_prompt_len, args.arrival_interval_ms, args.pure_s)
            print(json.dumps({**row, "model": model, "url": url}), flush=True)
        return
    for prompt_len in args.prompt_len:
        for concurrency in args.concurrency:
            row = await measure(client, model, concurrency, prompt_len, args.max_tokens, vocab, seed=concurrency,
                                api=args.api, server_pid=server_pid, sampling=Sampling(args.temperature, args.top_p))
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
    parser.add_argument("--api", choices=("completions", "chat"), default="completions")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    parser.add_argument("--scripted-step-ms", type=float,
                        help="serve the front end over a scripted engine stepping every MS ms (bench/scripted_engine.py)")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its CPU time per token")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--arrivals", type=int, default=0,
                        help="arrivals mode: this many new requests arrive while --concurrency streams decode")
    parser.add_argument("--arrival-prompt-len", type=int, default=2048, help="arrivals mode: their prompt tokens")
    parser.add_argument("--arrival-interval-ms", type=float, default=200.0, help="arrivals mode: their spacing")
    parser.add_argument("--pure-s", type=float, default=1.0, help="arrivals mode: pure decode measured first")
    args = parser.parse_args(argv)
    if args.url:
        asyncio.run(run_all(args, args.url, args.server_pid))
        return
    if args.scripted_step_ms is not None:
        module, server_args = "bench.scripted_engine", ["--step-ms", str(args.scripted_step_ms), *shlex.split(args.server_args)]
    else:
        module, server_args = "server", shlex.split(args.server_args)
    with served(server_args, args.port, args.ready_timeout_s, module) as (url, pid):
        asyncio.run(run_all(args, url, pid))


if __name__ == "__main__":
    main()
