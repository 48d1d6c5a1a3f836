"""The front end over real HTTP (`python -m server` on the tiny V4.1 checkpoint): bearer keys on every
protected endpoint, /tokenize and /detokenize, x-request-id, vLLM's request extras, the memory plan of
the default config, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import orjson
import pytest

from contract import NewRequest, RequestOutput, SamplingParams
from contract.config import ENV_API_KEY, load_config
from server.completions import stream_completion
from server.engine_client import EngineClient
from server.protocol import CompletionRequest
from tests.serving import CharTokenizer, FakeEngine, server_process

KEY = "sk-test-8d2f0c"
AUTH = {"authorization": f"Bearer {KEY}"}
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
]


@pytest.fixture(scope="module")
def keyed(checkpoints):
    """Access logs on, so the test can check that no key reaches them."""
    with server_process(checkpoints["v41"], "tiny", "--max-model-len", "512", "--log-level", "info",
                        env={ENV_API_KEY: KEY}) as server:
        yield server


@pytest.fixture(scope="module")
def base(keyed):
    return keyed.base


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def call(base: str, method: str, path: str, body: dict | None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers=headers)


@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_protected_endpoints_need_the_key(base, method, path, body):
    for headers in (None, {"authorization": "Bearer sk-wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        response = call(base, method, path, body, headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["type"] == "authentication_error" and response.json()["error"]["code"] == 401
    assert call(base, method, path, body, AUTH).status_code == 200


def test_health_ready_and_metrics_are_open(base):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(base + path).status_code == 200, path


def test_openai_client_with_a_wrong_key_is_an_authentication_error(base, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_keys_never_reach_the_logs(keyed):
    call(keyed.base, "GET", "/v1/models", None, {"authorization": "Bearer sk-wrong-secret"})
    call(keyed.base, "GET", "/v1/models", None, AUTH)
    time.sleep(0.2)
    assert "GET /v1/models" in keyed.output  # the access log is on
    assert KEY not in keyed.output and "sk-wrong-secret" not in keyed.output


def test_tokenize_detokenize_round_trip(base):
    text = "Hello world, how are you?"
    tokens = call(base, "POST", "/tokenize", {"prompt": text}, AUTH).json()
    plain = call(base, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}, AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(plain["tokens"]) + 1 and tokens["max_model_len"] == 512
    assert tokens["tokens"][1:] == plain["tokens"] and "".join(plain["token_strs"]) == text
    assert call(base, "POST", "/detokenize", {"tokens": plain["tokens"]}, AUTH).json() == {"prompt": text}
    with_bos = call(base, "POST", "/detokenize", {"tokens": tokens["tokens"]}, AUTH).json()["prompt"]
    assert with_bos.endswith(text) and with_bos != text  # special tokens are decoded too, as vLLM does
    served = httpx.post(base + "/v1/completions", headers=AUTH,
                        json={"prompt": text, "max_tokens": 1, "return_token_ids": True}).json()
    assert served["choices"][0]["prompt_token_ids"] == tokens["tokens"]  # what the completion saw


def test_tokenize_refuses_what_it_cannot_do(base):
    chat = call(base, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, AUTH)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    for body in ({}, {"prompt": "x", "messages": []}, {"prompt": 5}):
        assert call(base, "POST", "/tokenize", body, AUTH).status_code == 400, body
    outside = call(base, "POST", "/detokenize", {"tokens": [5, 512]}, AUTH)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert call(base, "POST", "/detokenize", {"tokens": "abc"}, AUTH).status_code == 400


def test_x_request_id_is_echoed_and_names_the_response(base):
    response = httpx.post(base + "/v1/completions", headers={**AUTH, "x-request-id": "trace-42.a:b_c"},
                          json={"prompt": "Hello", "max_tokens": 2})
    assert response.headers["x-request-id"] == "trace-42.a:b_c" and response.json()["id"] == "cmpl-trace-42.a:b_c"
    with httpx.stream("POST", base + "/v1/completions", headers={**AUTH, "x-request-id": "stream-1"},
                      json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as stream:
        assert stream.headers["x-request-id"] == "stream-1"
        first = orjson.loads(next(stream.iter_lines()).removeprefix("data: "))
    assert first["id"] == "cmpl-stream-1"
    for response in (httpx.get(base + "/health", headers={"x-request-id": "h1"}),
                     httpx.get(base + "/v1/models", headers={"x-request-id": "h1"}),  # 401
                     httpx.get(base + "/nothing", headers={**AUTH, "x-request-id": "h1"})):  # 404
        assert response.headers["x-request-id"] == "h1"
    generated = httpx.post(base + "/v1/completions", headers=AUTH, json={"prompt": "Hello", "max_tokens": 1})
    assert generated.json()["id"] == "cmpl-" + generated.headers["x-request-id"]
    for bad in ("x" * 200, "has space", "ü"):
        response = httpx.get(base + "/v1/models", headers={**AUTH, "x-request-id": bad.encode()})
        assert response.status_code == 400 and response.json()["error"]["param"] == "x-request-id"


def test_vllm_request_extras(client):
    both = client.completions.create(model="tiny", prompt="Hello", max_tokens=9, temperature=0,
                                     extra_body={"max_completion_tokens": 3, "ignore_eos": True, "cache_salt": "tenant-a",
                                                 "return_token_ids": True})
    choice = both.choices[0]
    assert both.usage.completion_tokens == 3 and len(choice.token_ids) == 3  # max_completion_tokens wins
    assert both.prompt_token_ids == choice.prompt_token_ids and len(choice.prompt_token_ids) == both.usage.prompt_tokens
    assert both.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_token_ids_and_continuous_usage(client):
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ))
    with_choices = [c for c in chunks if c.choices]
    assert [t for c in with_choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert with_choices[0].choices[0].prompt_token_ids == whole.choices[0].prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in with_choices[1:])
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == 3 for c in with_choices)
    assert not chunks[-1].choices and chunks[-1].usage.total_tokens == 8


def test_api_key_sources_in_order(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("sk-one\n\nsk-two\n")
    config = load_config(None, [f"server.api_key_file={key_file}"])
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    assert config.api_keys() == ("sk-one", "sk-two") and load_config().api_keys() == ()
    monkeypatch.setenv(ENV_API_KEY, "sk-env")
    assert config.api_keys() == ("sk-env",) and config.api_keys("sk-flag") == ("sk-flag",)


def test_default_config_affords_eight_sequences_of_4k(checkpoints):
    from engine.factory import build_engine_core

    config = load_config(None, [f"model.path={checkpoints['v41']}"])
    assert config.scheduler.max_num_seqs >= 8 and config.model.max_model_len >= 4096
    _, spec = build_engine_core(config, lambda output: None)
    assert spec.memory.num_pages * spec.memory.block_tokens >= 8 * 4096, spec.memory.describe()


def stream_frames(last: RequestOutput | None, interrupt: asyncio.Event | None) -> tuple[list[dict | str], list[str]]:
    """A one-choice stream that gets the token "a" and then `last` (or, without it, `interrupt` is set)."""
    async def run():
        client, engine = EngineClient(), FakeEngine()
        client.connect(engine)
        client.bind_loop(asyncio.get_running_loop())
        body = CompletionRequest(prompt=[5], max_tokens=10, stream=True)
        frames = stream_completion(body, "cmpl-r", client.call([NewRequest("r", [5], SamplingParams())]), CharTokenizer(),
                                   "tiny", interrupt)
        first = asyncio.ensure_future(anext(frames))
        await asyncio.sleep(0.05)  # the stream has submitted its request
        client.on_outputs([RequestOutput("r", new_token_ids=(ord("a"),))])
        seen = [await first]
        if last is not None:
            client.on_outputs([last])
        else:
            interrupt.set()
        seen += [frame async for frame in frames]
        return seen, engine.aborted

    frames, aborted = asyncio.run(run())
    return [f.decode().removeprefix("data: ").strip() for f in frames], aborted


def test_engine_failure_mid_stream_is_an_error_frame_then_done():
    frames, _ = stream_frames(RequestOutput("r", finished=True, finish_reason="error", error="step failed"), None)
    assert orjson.loads(frames[0])["choices"][0]["text"] == "a"
    assert orjson.loads(frames[1])["error"] == {"message": "step failed", "type": "internal_server_error", "param": None,
                                                "code": 500}
    assert frames[2:] == ["[DONE]"]


def test_drain_timeout_cuts_a_stream_off_and_aborts_its_engine_request():
    frames, aborted = stream_frames(None, asyncio.Event())
    assert orjson.loads(frames[1])["error"]["code"] == 503 and frames[2:] == ["[DONE]"]
    assert aborted == ["r"]


def read_stream(response: httpx.Response, lines: list[str], started: threading.Event) -> None:
    for line in response.iter_lines():
        if line:
            lines.append(line)
            started.set()


def test_sigterm_drains_then_exits_zero(checkpoints):
    """One stream finishes inside the drain; one outlives it and is cut off with an error frame."""
    with server_process(checkpoints["v41"], "tiny", "--set", "server.drain_timeout_s=10") as server:
        short, long, threads = [], [], []
        with httpx.Client(timeout=120) as http:
            streams = [http.send(http.build_request("POST", server.base + "/v1/completions", json={
                "prompt": "Hello", "max_tokens": tokens, "ignore_eos": True, "stream": True}), stream=True)
                for tokens in (30, 3000)]
            for response, lines in zip(streams, (short, long), strict=True):
                started = threading.Event()
                threads.append(threading.Thread(target=read_stream, args=(response, lines, started)))
                threads[-1].start()
                assert started.wait(60)
            server.process.send_signal(signal.SIGTERM)
            deadline = time.time() + 5
            while httpx.get(server.base + "/health").status_code != 503:
                assert time.time() < deadline, "/health did not turn 503"
                time.sleep(0.05)
            assert httpx.get(server.base + "/ready").status_code == 503
            refused = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
            for thread in threads:
                thread.join(60)
        assert short[-1] == "data: [DONE]" and orjson.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert not any("error" in orjson.loads(line[6:]) for line in short[:-1])
        assert long[-1] == "data: [DONE]" and orjson.loads(long[-2][6:])["error"]["code"] == 503
        assert server.process.wait(60) == 0, server.output
