"""Served decode beside the runner, in one run: the runner alone (bench.slice's decode steps), then the
server on the same dims and weights measured by `bench.http` and by llm_decode_bench (the benchmark the
V4 / V4.1 rig reports use), side by side per concurrency (JSON lines; optionally a BENCHMARKS.md table).

    python -m bench.served [--config configs/models/DeepSeek-V4-Flash/config.json] [--layers 4]
                           [--weights bf16|released] [--load-format dummy] [--model DIR]
                           [--concurrency 1 8 32] [--max-tokens 512] [--device cuda|cpu] [--dtype bfloat16]
                           [--llm-decode-bench PATH] [--ldb-duration-s 15] [--budget-s 500]
                           [--server-args "..."] [--write-benchmarks [BENCHMARKS.md]]

What is served: without --model, the first --layers layers of --config (bench.slice's slice_config),
written as a config-only directory (config.json and a tokenizer: --tokenizer's, or the tiny model's
padded with filler tokens to the config's vocab_size) in a temp folder and served with
`--load-format dummy` (seeded random weights at those dims, built on the device; `--weights released`
adds `--set model.quantization=checkpoint`). With --model, that checkpoint.

The phases, one after another in one process tree, so each has the GPU to itself:
1. runner: a subprocess (`python -m bench.served --runner-only ...`: its memory is freed before the
   server starts) builds the model the server will hold (the same directory's dummy weights, same seed
   and formats: models/dummy_weights.py; or the checkpoint) and times bench.slice's decode_steps at
   context 0 per concurrency, CUDA graphs on (the server's default); seeded random tokens feed each
   step, as bench.slice decode does: one after another ("serial": the host reads each step's tokens
   before planning the next) and overlapped ("overlapped": each step launched before the one before it
   lands, as the engine's async scheduling runs them: what the server could reach). Lines
   `served.runner`, one a mode.
2. `python -m server` on a free port until /health answers, stopped with SIGTERM after.
3. `python -m bench.http --url ...` against it (greedy, ignore_eos, --http-prompt-len tokens, --max-tokens
   a request, all requests at once). Line `served.http`: its row (decode_tokens_per_s, itl_ms_p50, ...).
4. llm_decode_bench (a path, run with this interpreter; never part of the project: skipped with a note
   when absent) at context 0, --max-tokens a request, --ldb-duration-s of sustained decode per cell.
   Line `served.llm_decode_bench`: its cell as it reports it (aggregate_tps; ITL / TTFT p50 in seconds;
   errors, capacity_limited, warmup_timed_out), with tokens_per_s (aggregate_tps, None where the cell
   says it is no steady-state figure) and itl_ms_p50.
Then one `served` line per concurrency: the figures and the served / runner ratios (against both runner
modes). Every line
carries commit and machine. --budget-s bounds the whole (each phase gets what is left; a phase cut off
leaves its cells empty, the rest is still reported). --write-benchmarks puts the table in BENCHMARKS.md,
replacing the section an earlier run of the same model, weights and device wrote.

On the lent H200 (llm_decode_bench copied into the ignored build/llm-bench/, carried with .whl/, whose
rich / markdown-it-py / mdurl / pygments it needs; est. 4-6 min: ~1 min the runner's draw and graphs,
~1-2 min the server's start, ~15 s bench.http, 3 x (<= 10 s warm-up + 15 s) llm_decode_bench):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; cp BENCHMARKS.md $OUT/; timeout 560 python3 -m bench.served --layers 4 --weights bf16 --concurrency 1 8 32 --max-tokens 512 --llm-decode-bench build/llm-bench/llm_decode_bench.py --budget-s 480 --commit SHA --write-benchmarks $OUT/BENCHMARKS.md 2>$OUT/served.err | tee $OUT/served.jsonl

(the tiny model: `--model default_model --concurrency 1`, the trained default the repository ships). A stop
past --budget-s costs at most the server's drain (60 s), so `timeout 560` is never reached by a healthy run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FLASH_CONFIG = REPO / "configs/models/DeepSeek-V4-Flash/config.json"
SERVED_NAME = "served-bench"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TAIL_LINES = 40


@dataclass(frozen=True)
class Cell:
    """One phase's figure at one concurrency; `tokens_per_s` None where the phase gave none."""

    tokens_per_s: float | None
    itl_ms_p50: float | None = None


@dataclass(frozen=True)
class RunInfo:
    """What every line and the table carry about the run."""

    commit: str
    machine: str
    label: str  # what was served, e.g. "DeepSeek-V4-Flash, 4 layers, bf16 weights (dummy), cuda"
    command: str


class Deadline:
    """The run's time budget: each phase's timeout is what is left of it."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self, cap: float | None = None) -> float:
        left = max(1.0, self.end - time.monotonic())
        return left if cap is None else min(cap, left)


def emit(row: dict[str, Any], info: RunInfo) -> None:
    print(json.dumps({**row, "commit": info.commit, "machine": info.machine}), flush=True)


def note(message: str) -> None:
    print(f"bench.served: {message}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-TAIL_LINES:]) if path.exists() else ""


def run_child(argv: list[str], log: Path, timeout_s: float, cwd: Path = REPO) -> str | None:
    """Runs `argv` (stdin closed, stderr to `log`); its stdout, or None (with the log's tail on stderr)
    when it failed or ran past `timeout_s`."""
    with log.open("w") as err:
        try:
            done = subprocess.run(argv, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=err, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            note(f"{shlex.join(argv[:4])} ... ran past {timeout_s:.0f} s; cut off\n{tail(log)}")
            return None
    if done.returncode != 0:
        note(f"{shlex.join(argv[:4])} ... exited with {done.returncode}\n{tail(log)}")
        return None
    return done.stdout


# --- phase 1: the runner alone ----------------------------------------------------------------------


def runner_model(args: argparse.Namespace):
    """The model the runner phase times, as the server holds it: dummy weights drawn from the same seed
    in the same formats (models/dummy_weights.py, what `--load-format dummy` serves), or the checkpoint."""
    import torch

    dtype = getattr(torch, args.dtype)
    released = args.weights == "released"
    if args.load_format == "dummy":
        from models.dummy_weights import build_dummy_model

        return build_dummy_model(args.model, args.seed, dtype, args.device, released=released)
    from models import load_model

    return load_model(args.model, dtype=dtype, device=args.device, keep_quantized=released)


def run_runner(args: argparse.Namespace) -> None:
    """--runner-only: `served.runner` lines per concurrency, serial then overlapped (bench.slice's
    decode_steps at context 0)."""
    import torch

    from bench.slice import decode_steps
    from worker import ModelRunner

    model = runner_model(args)
    most = max(args.concurrency)
    # a row: decode_steps' two untimed steps, and an overlapped row's three steps planned past its timed ones
    max_len = len(args.concurrency) * 2 * (args.runner_steps + 5) + 2
    runner = ModelRunner(model, most, max_len, device=args.device, cuda_graphs=True)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    generator = torch.Generator().manual_seed(args.seed)
    positions = [0] * most
    for concurrency in args.concurrency:
        for mode in RUNNER_MODES:
            measured = decode_steps(runner, positions, concurrency, args.runner_steps, args.runner_budget_s, generator,
                                    overlapped=mode == "overlapped")
            print(json.dumps({"bench": "served.runner", "mode": mode, "concurrency": concurrency,
                              "steps": measured["steps"], "tokens_per_s": measured["tokens_per_s"],
                              "step_ms_p50": measured["step_ms_p50"], "step_ms_p90": measured["step_ms_p90"],
                              "machine": machine}), flush=True)


RUNNER_MODES = ("serial", "overlapped")
RUNNER_FLAGS = ("weights", "device", "dtype", "seed", "load_format", "runner_steps", "runner_budget_s")


def runner_argv(args: argparse.Namespace, model_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "bench.served", "--runner-only", "--model", str(model_dir),
            "--concurrency", *map(str, args.concurrency)]
    for name in RUNNER_FLAGS:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def measure_runner(args: argparse.Namespace, model_dir: Path, work: Path, deadline: Deadline) -> list[dict[str, Any]]:
    out = run_child(runner_argv(args, model_dir), work / "runner.log", deadline.left())
    return [r for r in json_lines(out or "") if r.get("bench") == "served.runner"]


# --- phase 2: the server ----------------------------------------------------------------------------


def served_model_dir(args: argparse.Namespace, work: Path) -> Path:
    """--model as given, or a config-only directory of the slice: bench.slice's layer-cut config.json
    (for --weights released with the release's quantization keys back, as the checkpoint's config has
    them) and a tokenizer at its vocab_size (write_tokenizer)."""
    if args.model is not None:
        return Path(args.model)
    from bench.slice import slice_config

    raw = slice_config(Path(args.config), args.layers)
    if args.weights == "released":
        released = json.loads(Path(args.config).read_text())
        raw.update({k: released[k] for k in ("quantization_config", "expert_dtype") if k in released})
    directory = work / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    write_tokenizer(args.tokenizer, directory, raw["vocab_size"])
    return directory


def write_tokenizer(source: str | None, directory: Path, vocab_size: int) -> None:
    """--tokenizer's files, or the tiny model's byte-level BPE (DeepSeek's special tokens at the config's
    bos / eos ids 0 / 1) with filler tokens `<|id|>` added up to `vocab_size`: the server refuses a
    tokenizer smaller than the vocabulary (sampled ids would decode to nothing), and a random model's
    text is noise whatever the tokenizer."""
    if source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).exists():
                shutil.copy(Path(source) / name, directory / name)
        return
    from models.tiny import SPECIAL_TOKENS, TOKENIZER_VOCAB, build_tokenizer

    build_tokenizer(directory / "tokenizer.json", [f"<|{i}|>" for i in range(TOKENIZER_VOCAB, vocab_size)])
    settings = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
                "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def server_argv(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    argv = [sys.executable, "-m", "server", "--model", str(model_dir), "--port", str(port),
            "--served-model-name", SERVED_NAME, "--log-level", "warning", "--device", args.device,
            "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency))]
    if args.max_tokens + 1024 > 4096:  # the default config's 4096 holds a chat prompt and --max-tokens
        argv += ["--max-model-len", str(args.max_tokens + 1024)]
    if args.load_format == "dummy":  # the runner's seed, so both time the same weights
        argv += ["--load-format", "dummy", "--set", f"model.seed={args.seed}"]
    if args.weights == "released":
        argv += ["--set", "model.quantization=checkpoint"]
    return argv + shlex.split(args.server_args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(process: subprocess.Popen, base: str, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


@contextmanager
def served(args: argparse.Namespace, model_dir: Path, work: Path, deadline: Deadline) -> Iterator[str | None]:
    """The server's base URL once /health answers (None if it exited or did not get there in time, its
    log's tail on stderr); SIGTERM after, then its drain, then a kill past 60 s."""
    port = free_port()
    log = work / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(server_argv(args, model_dir, port), cwd=REPO, env=child_env(),
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        healthy = wait_healthy(process, base, deadline.left(args.ready_timeout_s))
        if not healthy:
            note(f"the server was not healthy (exit code {process.poll()})\n{tail(log)}")
        else:
            note(f"server healthy after {time.monotonic() - started:.0f} s")
        yield base if healthy else None
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- phases 3 and 4: the two benches against the server ---------------------------------------------


def measure_http(args: argparse.Namespace, base: str, work: Path, deadline: Deadline) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "bench.http", "--url", f"{base}/v1", "--model", SERVED_NAME,
            "--concurrency", *map(str, args.concurrency), "--prompt-len", str(args.http_prompt_len),
            "--max-tokens", str(args.max_tokens), "--vocab", str(args.http_vocab)]
    out = run_child(argv, work / "http.log", deadline.left())
    return [r for r in json_lines(out or "") if r.get("bench") == "http.decode"]


LDB_CELL_KEYS = ("concurrency", "aggregate_tps", "aggregate_source", "measurement_seconds", "client_output_tokens",
                 "inter_token_latency_p50", "ttft_p50", "request_count", "num_errors", "capacity_limited",
                 "warmup_timed_out", "effective_concurrency")


def ldb_argv(args: argparse.Namespace, base: str, output: Path) -> list[str]:
    """llm_decode_bench's decode matrix at context 0 only: plain output, no hardware sampler, no prefill
    phase, no calibration (context 0 needs none); its results go to `output` as JSON."""
    argv = [sys.executable, args.llm_decode_bench, "--host", base, "--model", SERVED_NAME,
            "--concurrency", ",".join(map(str, args.concurrency)), "--contexts", "0",
            "--max-tokens", str(args.max_tokens), "--duration", str(args.ldb_duration_s),
            "--decode-warmup-seconds", str(args.ldb_warmup_s), "--cell-warmup-timeout-seconds",
            str(args.ldb_cell_timeout_s), "--display-mode", "plain", "--no-hw-monitor",
            "--skip-prefill", "--no-calibration-cache", "--output", str(output)]
    key = os.environ.get("DS4SERVE_API_KEY")
    return argv + (["--api-key", key] if key else [])


def measure_ldb(args: argparse.Namespace, base: str, work: Path, deadline: Deadline) -> list[dict[str, Any]]:
    """Its cells at context 0 (units as it reports them: seconds), or [] when it is absent or failed.
    Its stdout (rich tables) goes to a log; the JSON file is what is read."""
    if not args.llm_decode_bench or not Path(args.llm_decode_bench).is_file():
        note(f"llm_decode_bench not found at {args.llm_decode_bench!r}: its column is skipped")
        return []
    output = work / "llm_decode_bench.json"
    log = work / "llm_decode_bench.log"
    stdout = run_child(ldb_argv(args, base, output), log, deadline.left(), cwd=work)  # cwd: files it may leave
    log.write_text(log.read_text() + (stdout or ""))
    if not output.exists():
        note(f"llm_decode_bench wrote no results\n{tail(work / 'llm_decode_bench.log')}")
        return []
    cells = [c for c in json.loads(output.read_text()).get("results", []) if c.get("context_tokens") == 0]
    rows = []
    for cell in cells:
        tokens = ldb_figure(cell)
        itl_s = cell.get("inter_token_latency_p50") if tokens is not None else None
        itl = 1000 * itl_s if itl_s else None
        rows.append({"bench": "served.llm_decode_bench", "tokens_per_s": tokens, "itl_ms_p50": itl,
                     **{k: cell.get(k) for k in LDB_CELL_KEYS}})
    return rows


def ldb_figure(cell: dict[str, Any]) -> float | None:
    """A cell's aggregate tokens/s, or None where it says it is no steady-state figure (its warm-up never
    reached the concurrency, the KV budget limited it, or nothing was measured)."""
    if cell.get("warmup_timed_out") or cell.get("capacity_limited") or not (cell.get("aggregate_tps") or 0) > 0:
        return None
    return cell["aggregate_tps"]


# --- the side-by-side rows and the table ------------------------------------------------------------


def by_concurrency(rows: list[dict[str, Any]], tokens_key: str, itl_key: str) -> dict[int, Cell]:
    return {r["concurrency"]: Cell(r.get(tokens_key), r.get(itl_key)) for r in rows}


def ratio(served: Cell | None, runner: Cell | None) -> float | None:
    if served is None or runner is None or not served.tokens_per_s or not runner.tokens_per_s:
        return None
    return served.tokens_per_s / runner.tokens_per_s


def side_by_side(args: argparse.Namespace, runner: list[dict], http: list[dict], ldb: list[dict]) -> list[dict]:
    """One `served` row per concurrency: the runner's serial and overlapped, bench.http decode and
    llm_decode_bench tokens/s (None where a phase gave none), ITL p50 in ms, and each served figure
    over both runner figures."""
    cells = (by_concurrency([r for r in runner if r.get("mode", "serial") == "serial"], "tokens_per_s", "step_ms_p50"),
             by_concurrency([r for r in runner if r.get("mode") == "overlapped"], "tokens_per_s", "step_ms_p50"),
             by_concurrency(http, "decode_tokens_per_s", "itl_ms_p50"),
             by_concurrency(ldb, "tokens_per_s", "itl_ms_p50"))
    rows = []
    for concurrency in args.concurrency:
        run, overlapped, web, ldb_cell = (c.get(concurrency) for c in cells)
        rows.append({
            "bench": "served", "concurrency": concurrency, "context": 0, "max_tokens": args.max_tokens,
            "runner_tokens_per_s": run and run.tokens_per_s, "runner_step_ms_p50": run and run.itl_ms_p50,
            "overlapped_tokens_per_s": overlapped and overlapped.tokens_per_s,
            "overlapped_step_ms_p50": overlapped and overlapped.itl_ms_p50,
            "http_tokens_per_s": web and web.tokens_per_s, "http_itl_ms_p50": web and web.itl_ms_p50,
            "ldb_tokens_per_s": ldb_cell and ldb_cell.tokens_per_s, "ldb_itl_ms_p50": ldb_cell and ldb_cell.itl_ms_p50,
            "http_to_runner": ratio(web, run), "ldb_to_runner": ratio(ldb_cell, run),
            "http_to_overlapped": ratio(web, overlapped), "ldb_to_overlapped": ratio(ldb_cell, overlapped),
        })
    return rows


def figure(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def with_itl(tokens: float | None, itl_ms: float | None) -> str:
    return figure(tokens) if tokens is None or itl_ms is None else f"{figure(tokens)} ({itl_ms:.2f})"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def both(serial: float | None, overlapped: float | None) -> str:
    """A served figure's ratios to the serial and the overlapped runner: "95% / 80%"."""
    return percent(serial) if overlapped is None else f"{percent(serial)} / {percent(overlapped)}"


def section_key(info: RunInfo) -> str:
    return "".join(c if c.isalnum() else "-" for c in info.label.lower()).strip("-")


def section(args: argparse.Namespace, info: RunInfo, rows: list[dict]) -> str:
    """The BENCHMARKS.md section of one run, between markers that name what was served (so a later run of
    the same model, weights and device replaces it)."""
    key = section_key(info)
    ldb = "llm_decode_bench (voipmonitor/llm-inference-bench)" if args.llm_decode_bench else "llm_decode_bench"
    lines = [
        f"<!-- bench.served: {key} -->",
        f"## Served decode beside the runner (`bench/served.py`): {info.label}",
        "",
        f"{info.machine}, commit `{info.commit or '?'}`, {date.today().isoformat()}: `{info.command}`",
        "",
        f"Context 0, {args.max_tokens} output tokens a request. Runner: bench.slice's decode steps on the same dims "
        "and weights (CUDA graphs, random tokens fed), step p50 ms in brackets: serial (each step's tokens read "
        "before the next is planned) and overlapped (each launched before the one before it lands, as the engine "
        "runs them). `bench.http`: decode tokens/s "
        f"(tokens after each first, all {args.http_prompt_len}-token greedy requests sent at once), ITL p50 ms. "
        f"{ldb}: sustained decode over {args.ldb_duration_s:g} s a cell (chat requests, ignore_eos), ITL p50 ms. "
        "Ratios: served over runner (serial / overlapped), this run.",
        "",
        "| concurrency | runner tok/s | runner overlapped tok/s | `bench.http` decode tok/s | llm_decode_bench tok/s "
        "| http / runner | llm_decode_bench / runner |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {with_itl(r['runner_tokens_per_s'], r['runner_step_ms_p50'])} "
                     f"| {with_itl(r.get('overlapped_tokens_per_s'), r.get('overlapped_step_ms_p50'))} "
                     f"| {with_itl(r['http_tokens_per_s'], r['http_itl_ms_p50'])} "
                     f"| {with_itl(r['ldb_tokens_per_s'], r['ldb_itl_ms_p50'])} "
                     f"| {both(r['http_to_runner'], r.get('http_to_overlapped'))} "
                     f"| {both(r['ldb_to_runner'], r.get('ldb_to_overlapped'))} |")
    lines.append(f"<!-- /bench.served: {key} -->")
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replaces the section with the same markers in `path`, or appends it (after one blank line)."""
    start, end = text.splitlines()[0], text.splitlines()[-1]
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        before, rest = old.split(start, 1)
        new = before + text.rstrip("\n") + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text if old.strip() else text
    path.write_text(new)


# --- the run ----------------------------------------------------------------------------------------


def git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def label(args: argparse.Namespace) -> str:
    weights = "released formats" if args.weights == "released" else f"{args.dtype} weights"
    source = " (dummy)" if args.load_format == "dummy" else ""
    if args.model is None:
        return f"{Path(args.config).parent.name}, {args.layers} layers, {weights}{source}, {args.device}"
    return f"{Path(args.model).name}, {weights}{source}, {args.device}"


def run_info(args: argparse.Namespace, argv: list[str], runner: list[dict]) -> RunInfo:
    """Commit (--commit, else git's), the machine (the runner subprocess names its device; without its
    lines, this host), what was served and the command line."""
    machine = runner[0]["machine"] if runner else platform.processor() or platform.machine()
    command = shlex.join(["python", "-m", "bench.served", *argv])
    return RunInfo(args.commit if args.commit is not None else git_commit(), machine, label(args), command)


def run(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """The four phases; returns the `served` rows (every phase's own lines are printed as they come)."""
    deadline = Deadline(args.budget_s)
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        work = Path(tmp)
        model_dir = served_model_dir(args, work)
        runner = measure_runner(args, model_dir, work, deadline)
        info = run_info(args, argv, runner)
        for row in runner:
            emit(row, info)
        http: list[dict] = []
        ldb: list[dict] = []
        with served(args, model_dir, work, deadline) as base:
            if base is not None:
                http = measure_http(args, base, work, deadline)
                for row in http:
                    emit({**row, "bench": "served.http"}, info)
                ldb = measure_ldb(args, base, work, deadline)
                for row in ldb:
                    emit(row, info)
    rows = side_by_side(args, runner, http, ldb)
    for row in rows:
        emit({**row, "label": info.label}, info)
    if args.write_benchmarks:
        write_section(Path(args.write_benchmarks), section(args, info, rows))
        note(f"wrote the table into {args.write_benchmarks}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(FLASH_CONFIG), help="a deepseek_v4 config.json to slice")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--weights", default="bf16", choices=["bf16", "released"],
                        help="bf16: every weight in --dtype; released: MXFP4 experts and FP8 linears kept packed")
    parser.add_argument("--model", help="serve this checkpoint directory instead of the slice (e.g. default_model)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                        help="the server's --load-format (default: dummy for the slice, auto with --model)")
    parser.add_argument("--tokenizer", default=None,
                        help="a directory with the slice's tokenizer.json (default: the tiny one padded to its vocab)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=512, help="output tokens a request (both served benches)")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when there is one")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runner-steps", type=int, default=32, help="timed decode steps a runner row")
    parser.add_argument("--runner-budget-s", type=float, default=6.0, help="a runner row stops past this (>= 3 steps)")
    parser.add_argument("--http-prompt-len", type=int, default=16)
    parser.add_argument("--http-vocab", type=int, default=500, help="bench.http's prompt ids come from [10, this)")
    parser.add_argument("--llm-decode-bench", default=None, help="path of llm_decode_bench.py (absent: skipped)")
    parser.add_argument("--ldb-duration-s", type=float, default=15.0, help="llm_decode_bench's measured seconds a cell")
    parser.add_argument("--ldb-warmup-s", type=float, default=3.0, help="llm_decode_bench's hidden C=1 warm-up")
    parser.add_argument("--ldb-cell-timeout-s", type=float, default=30.0,
                        help="llm_decode_bench's wait for a cell's streams to all run (then the cell has no figure)")
    parser.add_argument("--server-args", default="", help="more arguments of `python -m server`")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="the server's start, at most")
    parser.add_argument("--budget-s", type=float, default=500.0, help="the whole run at most (phases get what is left)")
    parser.add_argument("--commit", default=None, help="the commit lines report (default: git rev-parse --short HEAD)")
    parser.add_argument("--write-benchmarks", nargs="?", const=str(REPO / "BENCHMARKS.md"), default=None,
                        metavar="PATH", help="put the table in this file (default BENCHMARKS.md)")
    parser.add_argument("--runner-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.load_format is None:
        args.load_format = "dummy" if args.model is None else "auto"
    if args.model is not None:  # the children run in the repository root
        args.model = str(Path(args.model).resolve())
    if args.llm_decode_bench:
        args.llm_decode_bench = str(Path(args.llm_decode_bench).resolve())
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.runner_only:
        run_runner(args)
    else:
        run(args, argv)


if __name__ == "__main__":
    main()
