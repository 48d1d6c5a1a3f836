"""POST /v1/chat/completions through real HTTP (`python -m server` on the tiny V4.1 checkpoint) with
the official openai client, including a DSML tool call forced through the real engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from models.config import ModelConfig
from server.tokenizer import TextTokenizer
from tests.serving import DSML_CALL, running_dsml_server, running_server

HI = [{"role": "user", "content": "Hello, how are you?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
THINK_END = 6  # the tiny tokenizer's </think>
GREEDY = {"temperature": 0, "max_tokens": 12}
NO_THINK = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "1024") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return TextTokenizer(checkpoints["v41"], ModelConfig.from_file(checkpoints["v41"] / "config.json").bos_token_id)


def prompt_ids(server: str, messages: list[dict], **extra) -> list[int]:
    return httpx.post(server + "/tokenize", json={"messages": messages, **extra}).json()["tokens"]


def test_plain_chat(server, client):
    response = client.chat.completions.create(model="tiny", messages=HI, **GREEDY, extra_body=NO_THINK)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids(server, HI, **NO_THINK))
    assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens_details.cached_tokens >= 0


def test_list_of_text_parts_is_the_same_prompt(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, how are you?"}]}]
    assert prompt_ids(server, parts) == prompt_ids(server, HI)


def test_stream_equals_non_stream_and_reports_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=HI, **GREEDY, extra_body=NO_THINK)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HI, **GREEDY, extra_body=NO_THINK, stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_and_seed(client):
    def sample(n):
        return client.chat.completions.create(model="tiny", messages=HI, n=n, seed=7, max_tokens=8, extra_body=NO_THINK)

    first, again = sample(2), sample(2)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 16


def test_stop_string_cuts_the_content(client):
    full = client.chat.completions.create(model="tiny", messages=HI, **GREEDY, extra_body=NO_THINK).choices[0].message.content
    stop = full[len(full) // 2:][:2]
    cut = client.chat.completions.create(model="tiny", messages=HI, **GREEDY, stop=[stop], extra_body=NO_THINK)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == (full[: full.index(stop)] or None)


def test_logprobs_with_top_logprobs(client):
    response = client.chat.completions.create(
        model="tiny", messages=HI, **GREEDY, logprobs=True, top_logprobs=3, extra_body=NO_THINK | {"return_token_ids": True},
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == 12 == len(response.choices[0].model_extra["token_ids"])
    assert response.model_extra["prompt_token_ids"]
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_reasoning_on_and_off(client):
    on = client.chat.completions.create(
        model="tiny", messages=HI, **GREEDY,
        extra_body={"chat_template_kwargs": {"thinking": True}, "ignore_eos": True, "logit_bias": {str(THINK_END): -100}},
    ).choices[0].message
    assert on.content is None and on.model_extra["reasoning_content"] and on.model_extra["reasoning"] == on.model_extra["reasoning_content"]
    off = client.chat.completions.create(model="tiny", messages=HI, **GREEDY, extra_body=NO_THINK).choices[0].message
    assert off.content and off.model_extra.get("reasoning_content") is None


def test_tools_auto_and_required_are_served(client):
    """required is constrained decoding (tests/test_structured_outputs.py checks the calls)."""
    response = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice="auto", **GREEDY)
    assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")
    forced = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, tool_choice="required",
                                            **{**GREEDY, "max_tokens": 100})
    assert forced.choices[0].finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HI, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_client_mistakes_are_400(server, body, param):
    response = httpx.post(server + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_forced_reasoning_through_the_engine(server, client, tokenizer):
    """Distinct tokens forced in order: descending logit_bias, and a huge repetition penalty that
    sinks every token once drawn (and every prompt token), so the next biased one wins."""
    thinking = {"chat_template_kwargs": {"thinking": True}}
    prompt = set(prompt_ids(server, HI, **thinking))
    plain = [i for i in range(7, tokenizer.vocab_size)
             if i not in prompt and tokenizer.token_text(i).isalpha()]
    target = [plain[0], plain[1], THINK_END, plain[2]]
    bias = {str(t): 100.0 - 10 * k for k, t in enumerate(target)}
    extra = thinking | {"logit_bias": bias, "repetition_penalty": 1e6, "ignore_eos": True, "return_token_ids": True}
    response = client.chat.completions.create(model="tiny", messages=HI, temperature=0, max_tokens=4, extra_body=extra)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == target
    assert choice.message.model_extra["reasoning_content"] == tokenizer.decode(target[:2])
    assert choice.message.content == tokenizer.decode(target[3:])
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, temperature=0, max_tokens=4,
                                                 extra_body=extra, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == tokenizer.decode(target[:2])
    assert "".join(d.content or "" for d in deltas) == tokenizer.decode(target[3:])


@pytest.fixture(scope="module")
def dsml_server(tmp_path_factory):
    with running_dsml_server(tmp_path_factory.mktemp("dsml")) as served:
        yield served


def test_dsml_tool_call_and_reasoning_forced_through_the_engine(dsml_server):
    """Reasoning, </think>, a DSML call, then EOS, forced through the real engine: biases descend by
    0.35 per token and presence + frequency penalties sink a drawn token by 4, more than the 3.15
    span, so each step draws the next token of the sequence (prompt tokens are not penalised by
    these two, and the tool instructions in the prompt contain the same DSML tags)."""
    base, tokenizer = dsml_server
    target = [tokenizer.encode(DSML_CALL[0], add_special_tokens=False)[0], THINK_END]
    target += [tokenizer.encode(text, add_special_tokens=False)[0] for text in DSML_CALL[1:]] + [1]
    assert len(set(target)) == len(target) == 10
    bias = {str(token): 100.0 - 0.35 * k for k, token in enumerate(target)}
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="auto",
                temperature=0, max_tokens=20, presence_penalty=2.0, frequency_penalty=2.0,
                extra_body={"chat_template_kwargs": {"thinking": True}, "logit_bias": bias, "return_token_ids": True})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.model_extra["token_ids"] == target
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Let me check."
    assert not "".join(d.content or "" for d in deltas)
    fragments = [f for d in deltas for f in d.tool_calls or []]
    assert fragments[0].function.name == "get_weather" and fragments[0].id.startswith("chatcmpl-tool-")
    assert json.loads("".join(f.function.arguments or "" for f in fragments)) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
