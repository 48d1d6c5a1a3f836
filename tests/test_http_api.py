"""The served API through real HTTP: the official openai client and raw httpx against `python -m server`."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.conftest import hf_logits, hf_model, random_tokens
from tests.serving import running_server


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["mixed"], "tiny", "--max-model-len", "512") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(checkpoints):
    return hf_model(checkpoints["mixed"])


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 512 and models[0].root.endswith("mixed")


def test_greedy_tokens_are_the_oracle_argmax(client, reference):
    prompt = random_tokens(40, seed=21)
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=32, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    generated = response.choices[0].token_ids
    assert len(generated) == 32 and response.choices[0].finish_reason == "length"
    logits = hf_logits(reference, prompt + generated)
    for step, token in enumerate(generated):
        row = logits[len(prompt) - 1 + step]
        assert row[token] >= row.max() - 1e-4, f"token {step}: {token} is not the teacher-forced argmax"
    assert response.usage.prompt_tokens == 40 and response.usage.completion_tokens == 32


def test_echo_prompt_logprobs_match_oracle(client, reference):
    prompt = random_tokens(50, seed=22)
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    expected = torch.log_softmax(hf_logits(reference, prompt), dim=-1)
    for i in range(1, len(prompt)):
        assert abs(logprobs.token_logprobs[i] - expected[i - 1, prompt[i]].item()) <= 1e-4, f"prompt token {i}"
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])


def test_text_prompt_and_batch_of_prompts(client):
    response = client.completions.create(model="tiny", prompt=["Hello world", "The quick brown fox"], max_tokens=4, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens <= 8


def test_client_mistakes_are_400_with_openai_error_body(server, client):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=random_tokens(500, 1), max_tokens=100)
    assert "maximum context length is 512" in too_long.value.message
    for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": [], "max_tokens": 3}, {"prompt": [1, 2, 70000]},
                 {"prompt": "x", "temperature": "hot"}, {"max_tokens": 3}):
        response = httpx.post(server + "/v1/completions", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == 400
    response = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert httpx.get(server + "/health").status_code == 200  # still up


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=0.9, seed=1234, extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text


def test_streamed_completion_equals_unstreamed(client, server):
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_streamed_request_too_long_is_400_before_streaming(server):
    body = {"prompt": random_tokens(500, 3), "max_tokens": 100, "stream": True}
    response = httpx.post(server + "/v1/completions", json=body)
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]
