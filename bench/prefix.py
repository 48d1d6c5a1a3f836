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

    python -m bench.prefix --agentic [--sessions 16] [--turns 5] [--system-tokens 512] [--reuse 0.9]
                           [--answer-tokens 32] [--tiers off host host+disk] [--gpu-points N] [--gpu-pages N]
                           [--host-gb 0.004] [--disk-gb 0.05] [--disk-dir DIR] [--config YAML] [--set KEY=VALUE]

an agentic trace against the prefix cache's tiers (docs/prefix-tiers.md): `--sessions` chats at once,
each a shared system prompt of `--system-tokens`, a task of its own, then `--turns` requests, each
answer followed by a tool output sized so that `--reuse` of every request's prompt is an earlier one's
(the previous turn's prompt; for a first turn, the shared system prompt). The same trace runs once per
`--tiers` entry on a fresh server: off (the GPU's prefix cache alone), host (prefix_cache.host_gb) and
host+disk (prefix_cache.disk_gb too, files in a fresh directory under `--disk-dir`). For the tiers to
show anything the GPU tier must not hold the working set (every session's latest point): `--gpu-points`
sets scheduler.prefix_snapshots (a session resumes only from a state point, one snapshot slot each) and
`--gpu-pages` memory.num_kv_pages; the host tier is best sized below the working set too, so the disk
tier has something to add. Without `--config` (or `--set model.path=...`) a tiny V4.1 is built for the
run. The sizes scale by flags: on the H200, `--set runtime.device=cuda` for the tiny model or `--config`
a rig's YAML for a checkpoint, with e.g. `--system-tokens 16384 --turns 20 --sessions 32 --gpu-points 16
--host-gb 64 --disk-gb 512 --disk-dir /nvme`. Lines:
  {"bench": "prefix_agentic", "tiers", "requests", "prompt_tokens", "cached_tokens", "hit_rate" (cached /
   prompt tokens), "reusable_rate" (the most any cache could hit), "computed_tokens", "ttft_ms_p50",
   "ttft_ms_p99", "wall_s", "hits_by_tier" (cached tokens by the tier that served them, from /metrics),
   "tier_points" / "tier_tokens" (what each tier holds), "machine", "commit"}
  {"bench": "prefix_agentic_sizes", "sessions", "working_set_points", "working_set_tokens", "gpu_points",
   "gpu_tokens", "note" (how the GPU tier compares with the working set)}
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch

from bench.http import served
from contract.config import ServeConfig, load_config
from engine.layout import max_model_len, prefix_records, prefix_tiers, resolve_device, resolve_dtype
from models import ModelCache, ModelConfig, load_model
from models.tiny import CORPUS, build_tiny_checkpoint
from tests.serving import free_port, running_server
from tests.test_metrics import scrape

QUESTIONS = ["What is the main point?", "Say more about the server.", "And the attention?", "Summarise it all."]


def document(server: str, tokens: int, tag: str = "") -> str:
    """Corpus sentences, numbered (after `tag`) so that no two repeat, cut to about `tokens` tokens."""
    sentences, text = itertools.cycle(CORPUS), ""
    while True:
        for k in range(64):
            text += f"[{tag}{len(text)}] {next(sentences)} "
        count = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["count"]
        if count >= tokens:
            return text[: int(len(text) * tokens / count)]


def first_token(client: openai.OpenAI, messages: list[dict], extra: dict, max_tokens: int,
                model: str = "tiny") -> tuple[float, str, object]:
    """(TTFT in seconds, the answer text, usage) of one streamed chat completion."""
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
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

AGENTIC_EXTRA = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}  # one tenant: no cache_salt


@dataclass(frozen=True)
class AgenticTrace:
    """One run's texts, the same for every tier configuration."""

    system: str  # the shared system prompt
    tasks: list[str]  # each session's first user message
    tools: list[list[str]]  # each session's tool outputs, one after each turn but the last
    shared_tokens: int  # the prompt tokens every session's first turn shares


def prompt_ids(server: str, messages: list[dict]) -> list[int]:
    return httpx.post(server + "/tokenize", json={"messages": messages, **AGENTIC_EXTRA}).json()["tokens"]


def agentic_trace(server: str, args: argparse.Namespace) -> AgenticTrace:
    """Texts sized by the tokenizer: turn t's prompt is about system_tokens / reuse ** t tokens, so each
    request adds (1 / reuse - 1) of its predecessor's prompt (its answer included) and reuses the rest."""
    grow = 1 / args.reuse - 1
    first = args.system_tokens / args.reuse
    system = document(server, args.system_tokens)
    tasks = [document(server, max(1, round(first - args.system_tokens)), f"task {s}: ") for s in range(args.sessions)]
    tools = [[document(server, max(16, round(first * grow / args.reuse ** t) - args.answer_tokens), f"tool {s}.{t}: ")
              for t in range(args.turns - 1)] for s in range(args.sessions)]
    a, b = (prompt_ids(server, first_turn(system, task)) for task in (tasks[0], "?"))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return AgenticTrace(system, tasks, tools, shared)


def first_turn(system: str, task: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def agentic_session(client: openai.OpenAI, model: str, trace: AgenticTrace, session: int,
                    answer_tokens: int) -> list[dict]:
    """One session's turns in order: per request its prompt and cached tokens and its TTFT."""
    messages = first_turn(trace.system, trace.tasks[session])
    rows = []
    for tool in [*trace.tools[session], None]:
        ttft, answer, usage = first_token(client, messages, AGENTIC_EXTRA, answer_tokens, model)
        rows.append({"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                     "ttft_ms": 1000 * ttft})
        if tool is not None:
            messages += [{"role": "assistant", "content": answer or "ok"}, {"role": "tool", "content": tool}]
    return rows


def tier_sizes(config: ServeConfig) -> tuple[dict, dict]:
    """(state points, tokens) each tier of `config` holds, as the server sizes them (engine/factory.py);
    the GPU's tokens are None when the memory plan sizes its KV (memory.num_kv_pages unset)."""
    model_config = ModelConfig.from_file(config.model_dir / "config.json")
    dtype = resolve_dtype(config, resolve_device(config))
    limits = prefix_tiers(config, prefix_records(config, model_config, dtype, max_model_len(config, model_config)))
    block, pages = config.scheduler.block_tokens, config.memory.num_kv_pages
    points = {"gpu": config.scheduler.snapshot_slots, "host": limits.host_slots, "disk": limits.disk_slots}
    tokens = {"gpu": pages * block if pages else None, "host": limits.host_pages * block, "disk": limits.disk_pages * block}
    return points, tokens


def hits_by_tier(base: str, hits: int) -> dict[str, float]:
    """Hit tokens by the tier that served them (/metrics), once the engine's stats (sent every second)
    count all `hits`."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(base)
        counted = sum(v for (name, _), v in samples.items() if name == "ds4serve:prefix_cache_hits_total")
        if counted >= hits or time.monotonic() > deadline:
            return {dict(labels)["tier"]: v for (name, labels), v in samples.items()
                    if name == "ds4serve:prefix_cache_hits_by_tier_total"}
        time.sleep(0.2)


def agentic_summary(tiers: str, sessions: list[list[dict]], trace: AgenticTrace, wall_s: float) -> dict:
    rows = [row for session in sessions for row in session]
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    reusable = sum(trace.shared_tokens if turn == 0 else session[turn - 1]["prompt_tokens"]
                   for session in sessions for turn in range(len(session)))
    ttft = [r["ttft_ms"] for r in rows]
    return {
        "bench": "prefix_agentic", "tiers": tiers, "requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt, "reusable_rate": reusable / prompt, "computed_tokens": prompt - cached,
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_p99": statistics.quantiles(ttft, n=100, method="inclusive")[98] if len(ttft) > 1 else ttft[0],
        "wall_s": wall_s,
    }


def agentic(args: argparse.Namespace, commit: str, machine: str) -> None:
    """The trace once per --tiers entry, each on a fresh server; the sizes line last."""
    with tempfile.TemporaryDirectory(prefix="ds4serve-bench-") as tmp:
        base = list(args.set)
        if load_config(args.config, base).model.path is None:  # the tiny V4.1, long enough for the last turn
            max_len = math.ceil(args.system_tokens / args.reuse ** args.turns) + args.answer_tokens + 512
            model_dir = build_tiny_checkpoint(Path(tmp) / "tiny", max_position_embeddings=max(4096, 2 * max_len))
            base = [f"model.path={model_dir}", f"model.max_model_len={max_len}", *base]
        base += [f"scheduler.prefix_snapshots={args.gpu_points}"] if args.gpu_points is not None else []
        base += [f"memory.num_kv_pages={args.gpu_pages}"] if args.gpu_pages is not None else []
        trace, sessions = None, []
        for tiers in args.tiers:
            host_gb = args.host_gb if tiers != "off" else 0
            disk_gb = args.disk_gb if tiers == "host+disk" else 0
            overrides = [*base, f"prefix_cache.host_gb={host_gb}", f"prefix_cache.disk_gb={disk_gb}"]
            if disk_gb:
                overrides.append(f"prefix_cache.dir={tempfile.mkdtemp(prefix='prefix-disk-', dir=args.disk_dir or tmp)}")
            points, tokens = tier_sizes(load_config(args.config, overrides))
            server_args = [*(["--config", args.config] if args.config else []), *(f"--set={o}" for o in overrides),
                           "--log-level", "warning"]
            with served(server_args, free_port(), args.ready_timeout_s) as (url, _):
                client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
                model = client.models.list().data[0].id
                trace = trace or agentic_trace(url.removesuffix("/v1"), args)
                start = time.perf_counter()
                with ThreadPoolExecutor(args.sessions) as pool:
                    sessions = list(pool.map(lambda s: agentic_session(client, model, trace, s, args.answer_tokens),
                                             range(args.sessions)))
                row = agentic_summary(tiers, sessions, trace, time.perf_counter() - start)
                row["hits_by_tier"] = hits_by_tier(url.removesuffix("/v1"), row["cached_tokens"])
            print(json.dumps({**row, "host_gb": host_gb, "disk_gb": disk_gb, "tier_points": points,
                              "tier_tokens": tokens, "machine": machine, "commit": commit}), flush=True)
        working_set = sum(s[-1]["prompt_tokens"] for s in sessions) - (args.sessions - 1) * trace.shared_tokens
        kv = f" and {tokens['gpu']} tokens of KV pages (memory.num_kv_pages)" if tokens["gpu"] else ""
        print(json.dumps({
            "bench": "prefix_agentic_sizes", "sessions": args.sessions, "working_set_points": args.sessions,
            "working_set_tokens": working_set, "gpu_points": points["gpu"], "gpu_tokens": tokens["gpu"],
            "note": f"the working set is every session's latest state point: {args.sessions} points over {working_set}"
                    f" tokens (the shared system prompt once); the GPU tier holds {points['gpu']} points"
                    f" (scheduler.prefix_snapshots){kv}, and a session resumes only from a point, so between its turns"
                    " the other sessions' points evict its own unless a tier below keeps them (each line's tier_points"
                    " and tier_tokens)",
        }), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history-tokens", type=int, default=8192)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--thinking", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--state-costs", action="store_true", help="print the snapshot / page figures only")
    parser.add_argument("--agentic", action="store_true", help="the agentic trace over the prefix cache's tiers")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--reuse", type=float, default=0.9, help="share of each prompt an earlier request's holds")
    parser.add_argument("--tiers", nargs="+", choices=["off", "host", "host+disk"], default=["off", "host", "host+disk"])
    parser.add_argument("--gpu-points", type=int, help="scheduler.prefix_snapshots (default: the config's)")
    parser.add_argument("--gpu-pages", type=int, help="memory.num_kv_pages (default: the memory plan's)")
    parser.add_argument("--host-gb", type=float, default=0.004)
    parser.add_argument("--disk-gb", type=float, default=0.05)
    parser.add_argument("--disk-dir", help="where the disk tier's directory is made (default: a temporary one)")
    parser.add_argument("--config", help="the server's rig YAML (default: configs/cpu-tiny.yaml, a tiny V4.1 built)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server config override")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.state_costs:
        state_costs()
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = platform.processor() or platform.machine()
    if args.agentic:
        agentic(args, commit, machine)
        return
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
