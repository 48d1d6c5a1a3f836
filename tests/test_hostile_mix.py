"""Issue 21, the bounded hostile mix: 520 requests, 16 at a time, valid and hostile interleaved, through one
real server in deterministic (batch-invariant) mode. Every valid request's greedy tokens equal its solo run,
every hostile one gets its 4xx (never a 5xx), clients that leave mid-stream break nothing, `/health` answers
200 within 1 s throughout, and afterwards no request runs or waits and no KV page is held."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from tests.serving import server_process

MAX_MODEL_LEN = 256
CONCURRENCY = 16
TOTAL = 520
HEALTH_PERIOD_S = 0.1
HEALTH_LIMIT_S = 1.0


# --- the valid requests: greedy, fixed length (ignore_eos), compared with their solo run -------------------

@dataclass(frozen=True)
class Valid:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict  # without stream / return_token_ids

    @property
    def key(self) -> str:
        return json.dumps([self.path, self.body], sort_keys=True)


def completion(prompt, max_tokens: int) -> Valid:
    return Valid("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                     "ignore_eos": True})


def chat(content: str, max_tokens: int) -> Valid:
    return Valid("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                          "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


VALID = [
    completion("Hello world", 6),
    completion("The quick brown fox jumps over the lazy dog", 8),
    completion("a", 4),
    completion("", 5),  # BOS alone: a valid one-token prompt
    completion("Once upon a time, " * 8, 7),
    completion([5, 6, 7, 8, 9], 6),
    completion(list(range(20, 120)), 4),
    completion("Ünïcödé ✓ 漢字 🙂", 5),
    chat("hi", 4),
    chat("Tell me a story about a dragon.", 8),
    chat("2 + 2 = ?", 6),
    chat("x" * 100, 5),
]


def post_json(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, json=body)


def tokens_plain(client: httpx.Client, valid: Valid) -> tuple[int, list[int] | str]:
    response = client.post(valid.path, json={**valid.body, "return_token_ids": True})
    if response.status_code != 200:
        return response.status_code, response.text
    return 200, response.json()["choices"][0]["token_ids"]


def tokens_streamed(client: httpx.Client, valid: Valid) -> tuple[int, list[int] | str]:
    body = {**valid.body, "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    with client.stream("POST", valid.path, json=body) as response:
        if response.status_code != 200:
            return response.status_code, response.read().decode()
        done = False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return 599, data  # an error inside a 200 stream
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
        if not done:
            return 598, "stream ended without [DONE]"
    return 200, tokens


def tokens_openai(client: openai.OpenAI, valid: Valid) -> tuple[int, list[int] | str]:
    extra = {"ignore_eos": True, "return_token_ids": True}
    body = {k: v for k, v in valid.body.items() if k != "ignore_eos"}
    try:
        if valid.path == "/v1/completions":
            result = client.completions.create(**body, extra_body=extra)
        else:
            result = client.chat.completions.create(**body, extra_body=extra)
    except openai.APIStatusError as error:
        return error.status_code, str(error)
    return 200, result.choices[0].model_dump()["token_ids"]


# --- the hostile requests: each with the status it must get ------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    raw: bytes
    status: int


def hostile(name: str, path: str, body: dict | bytes, status: int = 400) -> Hostile:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Hostile(name, path, raw, status)


C, CHAT = "/v1/completions", "/v1/chat/completions"
OVERSIZE = "ab" * 200_000  # 400 KB: more characters than 256 tokens of this vocabulary can hold
HOSTILE = [
    hostile("malformed JSON", C, b'{"prompt": "x", "max_tokens": 4'),
    hostile("malformed JSON, chat", CHAT, b'{"messages": [{"role": "user", "content": "hi"}'),
    hostile("not an object", C, b'[1, 2, 3]'),
    hostile("invalid UTF-8", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    hostile("prompt of the wrong type", C, {"prompt": {"a": 1}, "max_tokens": 2}),
    hostile("max_tokens of the wrong type", C, {"prompt": "x", "max_tokens": "four"}),
    hostile("messages of the wrong type", CHAT, {"messages": "hi", "max_tokens": 2}),
    hostile("temperature -1", C, {"prompt": "x", "max_tokens": 4, "temperature": -1}),
    hostile("top_p 0", C, {"prompt": "x", "max_tokens": 4, "top_p": 0}),
    hostile("repetition_penalty 1e-39", C, {"prompt": "x", "max_tokens": 4, "repetition_penalty": 1e-39}),
    hostile("repetition_penalty 1e-39, chat", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, "repetition_penalty": 1e-39}),
    hostile("logit_bias out of vocab", C, {"prompt": "x", "max_tokens": 4, "logit_bias": {"999999": 5}}),
    hostile("max_tokens 0", C, {"prompt": "x", "max_tokens": 0}),
    hostile("n 0", C, {"prompt": "x", "max_tokens": 2, "n": 0}),
    hostile("oversize prompt string", C, {"prompt": OVERSIZE, "max_tokens": 2}),
    hostile("oversize chat message", CHAT, {"messages": [{"role": "user", "content": OVERSIZE}], "max_tokens": 2}),
    hostile("lone surrogate", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    hostile("lone surrogate, chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    hostile("lone surrogate, stream", C, b'{"prompt": "\\udfff", "max_tokens": 2, "stream": true}'),
    hostile("unknown model", C, {"model": "no-such-model", "prompt": "x", "max_tokens": 2}, 404),
    hostile("unknown model, chat", CHAT, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            404),
    hostile("too long by tokens", C, {"prompt": [5] * (MAX_MODEL_LEN + 40), "max_tokens": 2}),
    hostile("prompt + max_tokens over the context", C, {"prompt": [5] * (MAX_MODEL_LEN - 4), "max_tokens": 8}),
    hostile("token id out of vocab", C, {"prompt": [999_999], "max_tokens": 2}),
    hostile("empty prompt list", C, {"prompt": [], "max_tokens": 2}),
    hostile("empty messages", CHAT, {"messages": [], "max_tokens": 2}),
]
DISCONNECT = [  # streams the client closes after their first chunk
    {**completion("Leave early", 64).body, "stream": True},
    {**chat("Leave early, chat", 64).body, "stream": True},
]


def send_hostile(client: httpx.Client, case: Hostile) -> tuple[int, str]:
    response = client.post(case.path, content=case.raw, headers={"content-type": "application/json"})
    return response.status_code, response.text[:300]


def disconnect(client: httpx.Client, body: dict) -> tuple[int, str]:
    path = C if "prompt" in body else CHAT
    with client.stream("POST", path, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk: leave (closing the response drops the connection)
        return response.status_code, ""


# --- the watcher and the metrics ----------------------------------------------------------------------------

@dataclass
class HealthWatch:
    base: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (latency s, status; 0 = no answer)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError:
                    status = 0
                latency = time.monotonic() - started
                self.samples.append((latency, status))
                self.stop.wait(max(0.0, HEALTH_PERIOD_S - latency))


METRIC = re.compile(r'^(ds4serve:[a-z_]+)\{[^}]*\} ([0-9.e+-]+)$', re.M)


def engine_gauges(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {name: float(value) for name, value in METRIC.findall(text)}


# --- the test -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(checkpoints):
    with server_process(checkpoints["v41"], "tiny", "--deterministic", "--max-num-seqs", str(CONCURRENCY),
                        "--max-model-len", str(MAX_MODEL_LEN)) as process:
        yield process


def test_a_bounded_hostile_mix_leaves_valid_tokens_health_and_pages_intact(server):
    base = server.base
    with httpx.Client(base_url=base, timeout=120) as client:
        solo = {}
        for valid in VALID:  # each alone, before anything else runs
            status, tokens = tokens_plain(client, valid)
            assert status == 200, (valid, tokens)
            assert len(tokens) == valid.body["max_tokens"], (valid, tokens)
            solo[valid.key] = tokens

    # ~45 % valid (plain, streamed, openai), ~45 % hostile, ~10 % mid-stream disconnects, shuffled
    rng = random.Random(21)
    jobs: list[tuple[str, object]] = []
    for i in range(TOTAL):
        slot = i % 20
        if slot < 9:
            jobs.append((("plain", "stream", "openai")[slot % 3], VALID[i % len(VALID)]))
        elif slot < 18:
            jobs.append(("hostile", HOSTILE[i % len(HOSTILE)]))
        else:
            jobs.append(("disconnect", DISCONNECT[i % len(DISCONNECT)]))
    rng.shuffle(jobs)

    local = threading.local()

    def clients() -> tuple[httpx.Client, openai.OpenAI]:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=base, timeout=120)
            local.openai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        return local.http, local.openai

    def run(job: tuple[str, object]) -> tuple[str, object, int, object]:
        kind, case = job
        http, oai = clients()
        try:
            if kind == "plain":
                status, out = tokens_plain(http, case)
            elif kind == "stream":
                status, out = tokens_streamed(http, case)
            elif kind == "openai":
                status, out = tokens_openai(oai, case)
            elif kind == "hostile":
                status, out = send_hostile(http, case)
            else:
                status, out = disconnect(http, case)
        except (httpx.HTTPError, openai.APIConnectionError) as error:
            status, out = -1, repr(error)
        return kind, case, status, out

    watch = HealthWatch(base)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(run, jobs))
    finally:
        mix_s = time.monotonic() - started
        watch.stop.set()
        watcher.join(15)

    failures = []
    for kind, case, status, out in results:
        if kind in ("plain", "stream", "openai"):
            if status != 200:
                failures.append(f"{kind} {case.key}: {status} {out}")
            elif out != solo[case.key]:
                failures.append(f"{kind} {case.key}: tokens {out} != solo {solo[case.key]}")
        elif kind == "hostile":
            if status != case.status:
                failures.append(f"hostile {case.name!r}: {status} (expected {case.status}) {out}")
        elif status != 200:
            failures.append(f"disconnect: {status} {out}")
    latencies = [latency for latency, _ in watch.samples]
    worst = max(latencies)
    print(f"\nhostile mix: {TOTAL} requests in {mix_s:.1f} s; /health polled {len(latencies)} times, "
          f"max {worst * 1000:.0f} ms, mean {sum(latencies) / len(latencies) * 1000:.1f} ms")
    assert not failures, f"{len(failures)} of {TOTAL} went wrong:\n" + "\n".join(failures[:40])
    assert len(watch.samples) >= mix_s / (HEALTH_PERIOD_S + HEALTH_LIMIT_S)
    assert all(status == 200 for _, status in watch.samples), [s for s in watch.samples if s[1] != 200][:10]
    assert worst < HEALTH_LIMIT_S, f"/health took {worst:.3f} s at worst"

    # Afterwards: nothing runs or waits and no page is held (the engine reports about once a second).
    deadline, gauges = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        gauges = engine_gauges(base)
        if gauges.get("ds4serve:kv_pages_total", 0) > 0 and all(
                gauges.get(f"ds4serve:{name}") == 0
                for name in ("num_requests_running", "num_requests_waiting", "kv_pages_held")):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the engine did not return to idle: {gauges}")

    # The server still serves, bit for bit, and said nothing alarming.
    with httpx.Client(base_url=base, timeout=60) as client:
        assert tokens_plain(client, VALID[0]) == (200, solo[VALID[0].key])
    assert server.process.poll() is None
    assert "Traceback" not in server.output, server.output[-4000:]
