"""Starts the real server (`python -m server`) in a subprocess for API tests and stops it after; and the
test doubles that tests of the output path share (CharTokenizer, FakeEngine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from contract import NewRequest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class FakeEngine:
    """Records aborts; the test plays the engine's outputs itself."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def submit(self, request: NewRequest) -> None: ...

    def validate(self, request: NewRequest) -> None: ...

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@dataclass(frozen=True)
class ServerProcess:
    base: str  # the base URL
    process: subprocess.Popen
    lines: list[str]  # its stdout and stderr so far (a thread keeps reading, so the pipe never fills)

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _collect(stream, lines: list[str]) -> None:
    lines.extend(stream)  # line by line, as the server writes them


@contextmanager
def server_process(
    model_dir: Path | None, served_name: str, *extra_args: str, env: dict[str, str] | None = None,
    launcher: tuple[str, ...] = (),
) -> Iterator[ServerProcess]:
    """The server once /health answers 200 (`env` adds to the environment); fails the test with the
    server's output if it exits first. Stopped with SIGTERM after, unless the test stopped it.
    `model_dir` None: no --model, so the embedded default (default_model/) is served.
    `launcher`: what runs `-m server ...` instead of this interpreter (e.g. torchrun's arguments)."""
    port = free_port()
    model = ["--model", str(model_dir)] if model_dir is not None else []
    process = subprocess.Popen(
        [*(launcher or (sys.executable,)), "-m", "server", *model, "--port", str(port),
         "--served-model-name", served_name, "--log-level", "warning", *extra_args],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=_collect, args=(process.stdout, lines), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    # a start imports torch and builds the model: ~10 s alone, but minutes on a 2-core machine whose
    # other core runs another server or a CPU-bound test, so the deadline only catches a hung start
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if process.poll() is not None:
                reader.join(5)
                pytest.fail(f"server exited: {''.join(lines)}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not become healthy")
        yield ServerProcess(base, process, lines)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def dropped_stream(llm, model: str, prompt: str) -> None:
    """A streamed completion the client drops after its third chunk: an abort mid-decode, which must
    cost the requests beside it nothing."""
    stream = llm.completions.create(model=model, prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for index, _ in enumerate(stream):
        if index == 2:
            stream.close()
            return


def settled_metrics(base: str, *names: str, timeout: float = 30) -> tuple[float, ...]:
    """Each metric of `names` (full names, e.g. "vllm:num_preemptions_total") summed over its series, from
    one scrape taken once the engine is idle as its stats say and they stopped changing over a stats
    interval: the engine sends its stats at most once a second, so a scrape right after the last
    response may not hold its counts yet, and two scrapes may straddle a frame."""
    from engine.process import STATS_INTERVAL_S

    wanted = (*names, "vllm:num_requests_running", "vllm:num_requests_waiting")

    def scrape() -> tuple[float, ...]:
        lines = httpx.get(base + "/metrics").text.splitlines()
        return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((f"{name}{{", f"{name} ")))
                     for name in wanted)

    deadline = time.monotonic() + timeout
    last = scrape()
    while True:
        time.sleep(STATS_INTERVAL_S + 0.3)
        now = scrape()
        if now == last and now[-2:] == (0, 0):
            return now[:-2]
        assert time.monotonic() < deadline, f"the metrics never settled: {last} -> {now}"
        last = now


@contextmanager
def running_server(
    model_dir: Path | None, served_name: str, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Yields the base URL of a healthy server (see server_process)."""
    with server_process(model_dir, served_name, *extra_args, env=env) as server:
        yield server.base


DSML_CALL = [  # one added token each in dsml_checkpoint's tokenizer, so the call is a sequence of distinct ids
    "Let me check.", "<｜DSML｜ calls>\n", '<｜DSML｜ invoke name="get_weather">\n',
    '<｜DSML｜ parameter name="city" string="true">', "Oslo", "</｜DSML｜ parameter>\n",
    "</｜DSML｜ invoke>\n", "</｜DSML｜ calls>",
]


@contextmanager
def running_dsml_server(root: Path) -> Iterator[tuple[str, object]]:
    """A server on a tiny V4.1 whose tokenizer holds DSML_CALL as tokens and whose output head is
    scaled to 1%, so every logit lies within ~0.1 of the others and logit_bias plus penalties decide
    the order; yields (base URL, its TextTokenizer)."""
    from safetensors.torch import load_file, save_file

    from models.config import ModelConfig
    from models.tiny import build_tiny_checkpoint
    from server.tokenizer import TextTokenizer

    model_dir = build_tiny_checkpoint(root, extra_tokens=DSML_CALL)
    weights = load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 0.01
    save_file(weights, str(model_dir / "model.safetensors"))
    with running_server(model_dir, "tiny", "--max-model-len", "1024") as base:
        yield base, TextTokenizer(model_dir, ModelConfig.from_file(model_dir / "config.json").bos_token_id)
