"""The engine in its own process: the wire codec, a real engine process behind an EngineClient, and a
served engine that dies (in-flight requests fail, /health 503, the HTTP server stays up)."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from contract import (
    Abort,
    EngineFailed,
    EngineLimits,
    EngineReady,
    EngineStats,
    EngramStats,
    ExpertOffloadStats,
    ModelFacts,
    NewRequest,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    Shutdown,
    StepOutputs,
    TokenLogprob,
)
from contract.codec import decode, encode
from contract.config import load_config
from engine.factory import build_engine_core
from server.engine_client import EngineClient
from server.engine_process import EngineProcess, EngineStartError
from tests.serving import running_server, server_process

PARAMS = SamplingParams(
    max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, ignore_eos=True, stop_token_ids=(4, 9),
    logprobs=2, prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
    logit_bias=((3, -1.5), (7, 2.0)), min_tokens=2,
)


def test_codec_round_trips_every_message():
    messages = [
        NewRequest("r-1", [5, 6, 7], PARAMS),
        NewRequest("r-2", [1], SamplingParams()),
        Abort("r-1"),
        Shutdown(),
        EngineReady(EngineLimits(8, 512, 256, 512, (1, 2), num_pages=16, block_tokens=64), "cpu", "float32",
                    ModelFacts("deepseek_v41", 0, (1, 2))),
        StepOutputs((
            RequestOutput(
                "r-1", new_token_ids=(11,), new_logprobs=(TokenLogprob(11, -0.25, ((11, -0.25), (3, -math.inf))),),
                prompt_logprobs=(None, TokenLogprob(6, -math.inf), TokenLogprob(7, -2.5, ((7, -2.5),))),
                finished=True, finish_reason="length", num_prompt_tokens=3,
            ),
            RequestOutput("r-2", finished=True, finish_reason="error", error="step failed: boom", num_prompt_tokens=1),
        )),
        EngineStats(running=3, waiting=1),
        EngineStats(running=1, waiting=0, engram=EngramStats(rows_disk=7, wait_sum_s=0.5, wait_buckets=(1, 2, 3))),
        EngineStats(running=1, waiting=0, offload=ExpertOffloadStats(pairs_staged=5, bytes_copied=1 << 33, swaps=2)),
        EngineFailed("the engine loop died"),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def engine_config(checkpoint: Path):
    return load_config(None, [], {"model": str(checkpoint), "max_model_len": 256, "max_num_seqs": 4})


@pytest.fixture(scope="module")
def engine(checkpoints):
    client = EngineClient()
    process = EngineProcess(engine_config(checkpoints["v41"]), client, client.on_engine_dead)
    client.connect(process)
    yield client, process
    process.stop()
    assert process.process.exitcode == 0


async def collect(client: EngineClient, request: NewRequest) -> list[RequestOutput]:
    client.bind_loop(asyncio.get_running_loop())
    return [output async for output in client.generate(request)]


def in_process(config, request: NewRequest) -> list[RequestOutput]:
    """The same request through an EngineCore on a thread of this process: the reference."""
    outputs: list[RequestOutput] = []
    core, _ = build_engine_core(config, outputs.extend)
    core.start()
    core.submit(request)
    deadline = time.time() + 60
    while not (outputs and outputs[-1].finished) and time.time() < deadline:
        time.sleep(0.01)
    core.stop()
    return outputs


def test_engine_process_serves_what_the_in_process_engine_serves(engine, checkpoints):
    client, process = engine
    assert process.ready.max_model_len == 256 and process.ready.limits.max_num_seqs == 4
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    requests = [NewRequest(f"same-{i}", [5, 9, 33, 70, 12], greedy) for i in range(2)]
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True)
    requests.append(NewRequest("other", [40, 41, 42], sampled))

    async def run_all():
        return await asyncio.gather(*(collect(client, r) for r in requests))

    served = asyncio.run(run_all())
    for outputs, request in zip(served, requests, strict=True):
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outputs) == request.params.max_tokens
    reference = in_process(engine_config(checkpoints["v41"]), NewRequest("same-0", [5, 9, 33, 70, 12], greedy))
    for outputs in served[:2]:  # batched in the engine process vs alone in this one: same tokens, close logprobs
        assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in reference]
        got = [lp for o in outputs for lp in o.new_logprobs] + list(outputs[0].prompt_logprobs[1:])
        want = [lp for o in reference for lp in o.new_logprobs] + list(reference[0].prompt_logprobs[1:])
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert max(abs(g.logprob - w.logprob) for g, w in zip(got, want, strict=True)) <= 1e-4
        assert all(len(g.top) == len(w.top) for g, w in zip(got, want, strict=True))


def test_abort_and_stats(engine):
    client, process = engine
    request = NewRequest("long", [5, 6, 7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))

    async def abort_after_first_token() -> list[RequestOutput]:
        client.bind_loop(asyncio.get_running_loop())
        outputs = []
        async for output in client.generate(request):
            if not outputs:
                process.abort(request.request_id)
            outputs.append(output)
        return outputs

    outputs = asyncio.run(abort_after_first_token())
    assert outputs[-1].finish_reason == "abort" and sum(len(o.new_token_ids) for o in outputs) < 200
    deadline = time.time() + 10
    def idle(stats: EngineStats | None) -> bool:
        return stats is not None and stats.running == stats.waiting == stats.pages_held == 0

    while not idle(client.stats) and time.time() < deadline:
        time.sleep(0.1)
    assert idle(client.stats) and client.stats.pages_total > 0 and client.stats.steps > 0
    after = NewRequest("after", [8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert asyncio.run(collect(client, after))[-1].finish_reason == "length"


def test_front_end_rejects_before_sending(engine):
    client, _ = engine
    with pytest.raises(RequestRejected, match="maximum context length is 256"):
        client.validate(NewRequest("too-long", [5] * 200, SamplingParams(max_tokens=100)))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        asyncio.run(collect(client, NewRequest("bad-id", [5, 10**6], SamplingParams(max_tokens=2))))


@pytest.mark.parametrize("tmpdir_length", ["short", "past a socket path"])
def test_startup_failure_is_a_clear_error(checkpoints, tmp_path, monkeypatch, tmpdir_length):
    """The engine's own failure reaches the caller, whatever TMPDIR is: one too long for a unix socket's
    path puts the sockets in /tmp (without that fallback ZeroMQ refuses to bind, "File name too long")."""
    broken = tmp_path / "no-weights"
    shutil.copytree(checkpoints["v41"], broken, ignore=shutil.ignore_patterns("*.safetensors*"))
    workdirs = tmp_path / ("tmp" if tmpdir_length == "short" else "t" * 120)
    workdirs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(workdirs))  # where the sockets' directory goes
    engines_before = _engine_children(os.getpid())
    expected = "the engine failed to start: CheckpointError: .*no \\*.safetensors"
    with pytest.raises(EngineStartError, match=expected) as failure:
        EngineProcess(engine_config(broken), EngineClient(), lambda reason: None)
    assert isinstance(failure.value, ValueError)  # the CLI's `cannot start: ...`
    assert _engine_children(os.getpid()) == engines_before and not list(workdirs.iterdir())


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == pid:
            found.append(int(status.parent.name))
    return found


def _engine_children(pid: int) -> set[int]:
    """Children started by multiprocessing's spawn (not its resource tracker)."""
    return {child for child in _children(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()}


def engine_pid(base: str) -> int:
    """The engine process of the `python -m server` listening at `base`."""
    port = base.rsplit(":", 1)[1]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"server" in args and port.encode() in args:
            (child,) = _engine_children(int(cmdline.parent.name))
            return child
    raise AssertionError(f"no engine process found for {base}")


def gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return True  # exited; only its parent's reap is pending
        except OSError:
            return True
        time.sleep(0.1)
    return False


def in_flight_when_the_engine_is_killed(base: str, body: dict) -> tuple[tuple[int, list[str]], httpx.Response]:
    """A stream and a plain call, both in flight (the engine stopped) when the engine is SIGKILLed."""
    pid = engine_pid(base)
    os.kill(pid, signal.SIGSTOP)  # the requests below stay in flight until the kill
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            results["stream"] = (response.status_code, list(response.iter_lines()))

    def plain() -> None:
        results["plain"] = httpx.post(base + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    status, lines = results["stream"]
    return (status, [line for line in lines if line]), results["plain"]


def test_a_killed_engine_fails_in_flight_calls_with_503_and_is_started_again(checkpoints):
    with running_server(checkpoints["v41"], "tiny41", "--max-model-len", "256") as base:
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        first = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200
        killed = engine_pid(base)
        (status, frames), plain = in_flight_when_the_engine_is_killed(base, body)
        assert status == 200 and frames[-1] == "data: [DONE]" and "engine process died" in frames[-2]
        assert orjson.loads(frames[-2].removeprefix("data: "))["error"]["code"] == 503
        assert plain.status_code == 503 and "engine process died" in plain.json()["error"]["message"]
        statuses, deadline = set(), time.time() + 120
        while time.time() < deadline:  # 503 while the new engine loads, then 200
            health = httpx.get(base + "/health")
            statuses.add(health.status_code)
            if health.status_code == 200:
                break
            assert "killed by signal 9" in health.json()["error"]["message"]
            time.sleep(0.1)
        assert statuses == {503, 200}
        assert engine_pid(base) != killed
        again = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_past_its_restart_budget_the_server_exits_non_zero(checkpoints):
    with server_process(checkpoints["v41"], "tiny41", "--max-model-len", "256",
                        "--set", "server.engine_restarts=0") as server:
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        (status, frames), plain = in_flight_when_the_engine_is_killed(server.base, body)
        assert "engine process died" in frames[-2] and plain.status_code == 503
        assert server.process.wait(30) == 1  # for compose's restart policy (or any supervisor) to act on
        assert any("server.engine_restarts" in line for line in server.lines)


def test_server_shutdown_stops_the_engine(checkpoints):
    with running_server(checkpoints["v41"], "tiny41") as base:
        pid = engine_pid(base)
    assert gone(pid), "the engine process outlived the server"
