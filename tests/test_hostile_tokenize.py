"""Issue 21 items 2 and 6: prompts too long to tokenize are refused unread, tokenizing runs off the
event loop (the server answers others meanwhile), and lone surrogates are 400s, not 500s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serving import running_server

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def base(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", str(MAX_MODEL_LEN)) as url:
        yield url


def post(base: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=120)


def test_a_prompt_longer_than_the_context_could_hold_is_refused_without_tokenizing(base):
    huge = "ab" * 4_000_000  # 8 MB of text: far more characters than 256 tokens can hold
    response = httpx.post(base + "/v1/completions", json={"prompt": huge, "max_tokens": 1}, timeout=120)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and "maximum context length is 256 tokens" in error["message"]
    chat = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]}, timeout=120)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_the_server_answers_while_a_large_text_is_tokenized(base):
    text = "word " * 1_500_000  # 7.5 MB: /tokenize counts it whatever the context (as vLLM's does); seconds of work
    times: dict[str, float] = {}

    def tokenize() -> None:
        began = time.monotonic()
        response = httpx.post(base + "/tokenize", json={"prompt": text}, timeout=300)
        assert response.status_code == 200 and response.json()["count"] > MAX_MODEL_LEN
        times["tokenize"] = time.monotonic() - began

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.5)  # the body is in, the tokenizer at work
    began = time.monotonic()
    health = httpx.get(base + "/health", timeout=60)
    times["health"] = time.monotonic() - began
    completion = httpx.post(base + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True},
                            timeout=60)
    times["completion"] = time.monotonic() - began
    worker.join(300)
    assert health.status_code == 200 and completion.status_code == 200
    # relative, not a wall-clock bound: a tokenizer holding the event loop (or the GIL) makes these
    # wait for most of the tokenizing
    assert times["health"] < times["tokenize"] / 4 and times["completion"] < times["tokenize"] / 2, times


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(base, path, raw, param):
    response = post(base, path, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_prompt(base):
    response = httpx.post(base + "/v1/completions", json={"prompt": [5, 999999], "max_tokens": 2}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt" and "outside the vocabulary" in response.json()["error"]["message"]
