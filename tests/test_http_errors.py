"""Client mistakes over real HTTP (`python -m server` on the tiny V4.1 checkpoint): each gets the right
4xx with an OpenAI error body, the official client raises the right exception class, and the server
stays healthy. Also the full queue (429 + Retry-After) and aborts when a client leaves."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import random_tokens
from tests.serving import running_server

MAX_BODY = 65536


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "512",
                        "--set", f"server.max_body_bytes={MAX_BODY}") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert "loc" not in error["message"] and "pydantic" not in error["message"]  # never a validation dump
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert response.headers["x-request-id"]
    return error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": 5.5}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "sometimes"}, "stream"),
    ({"prompt": "x", "stop": 7}, "stop"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, None),  # past the context length; also past 64 bits
    ({"prompt": "x", "max_completion_tokens": 100000}, None),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "top_k": 2**40}, "top_k"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),  # without stream
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 2, 10**20]}, None),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_fields_are_400(server, body, param):
    error = assert_openai_error(httpx.post(server + "/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [
    b"{not json",
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b'["prompt"]',
    b"",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "repetition_penalty": Infinity}',
])
def test_bodies_that_are_not_a_request_object_are_400(server, content):
    response = httpx.post(server + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_invalid_utf8_is_named(server):
    response = httpx.post(server + "/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert "UTF-8" in assert_openai_error(response, 400)["message"]


def test_over_long_prompt_is_400_streamed_or_not(server, client):
    for stream in (False, True):
        body = {"prompt": random_tokens(500, 1), "max_tokens": 100, "stream": stream}
        error = assert_openai_error(httpx.post(server + "/v1/completions", json=body), 400)
        assert "maximum context length is 512" in error["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt=random_tokens(500, 1), max_tokens=100)


def test_unknown_model_and_route_are_404(server, client):
    for path, body in (("/v1/completions", {"model": "other", "prompt": "x"}), ("/tokenize", {"model": "other", "prompt": "x"}),
                       ("/detokenize", {"model": "other", "tokens": [5]}), ("/v1/nothing", {})):
        error = assert_openai_error(httpx.post(server + path, json=body), 404)
        assert error["type"] == "not_found_error"
    assert_openai_error(httpx.get(server + "/nothing"), 404)
    assert_openai_error(httpx.get(server + "/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.post("/nothing", body={}, cast_to=httpx.Response)


def test_oversized_body_is_413(server, client):
    big = {"prompt": "a" * MAX_BODY, "max_tokens": 1}
    assert_openai_error(httpx.post(server + "/v1/completions", json=big), 413)

    def chunks():  # no content-length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    response = httpx.post(server + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="a" * MAX_BODY, max_tokens=1)
    assert caught.value.status_code == 413


def test_openai_client_raises_bad_request_for_client_mistakes(client):
    for kwargs in ({"max_tokens": -1}, {"logprobs": 21}, {"temperature": "hot"}, {"extra_body": {"top_k": "x"}}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", **kwargs)


def test_server_is_healthy_after_the_bad_inputs(server, client):
    assert httpx.get(server + "/health").status_code == 200
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3


# One running sequence and one waiting place: the third request is refused.
@pytest.fixture(scope="module")
def small_queue(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-num-seqs", "1", "--max-model-len", "4096",
                        "--set", "server.max_waiting=1") as base:
        yield base


LONG = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}


def completes_quickly(base: str, within_s: float = 20.0) -> bool:
    """A short request finishes within `within_s`: the single running place is free."""
    started = time.time()
    response = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    return response.status_code == 200 and time.time() - started < within_s


def test_full_queue_is_429_with_retry_after_and_streams_that_leave_are_aborted(small_queue):
    url = small_queue + "/v1/completions"
    with httpx.Client(timeout=60) as running, httpx.Client(timeout=60) as waiting, \
            running.stream("POST", url, json={**LONG, "stream": True}) as first:
        first_lines = first.iter_lines()  # held: closing the iterator would close the connection
        next(first_lines)  # it runs
        with waiting.stream("POST", url, json={**LONG, "stream": True}) as second:
            assert second.status_code == 200  # admitted; it waits for the running place
            refused = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
            assert_openai_error(refused, 429)
            assert int(refused.headers["retry-after"]) >= 1
            client = openai.OpenAI(base_url=small_queue + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model="tiny", prompt="x", max_tokens=2)
    # both streams' clients left: had their engine requests not been aborted, the next one would wait minutes
    assert completes_quickly(small_queue)


def test_a_non_streaming_client_that_leaves_is_aborted(small_queue):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_queue + "/v1/completions", json=LONG, timeout=2)
    assert completes_quickly(small_queue)
