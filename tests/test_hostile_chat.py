"""Chat bodies nested too deep for the recursive walks of rendering (issue 21, item 6): tool parameters
or message fields nested 700 deep are a 400 naming the field (they were a RecursionError, 500), the
bound leaves real schemas alone, and the server stays healthy. Through a real server with the openai
client."""

from __future__ import annotations

import httpx
import openai
import pytest

from server.chat.request import MAX_NESTING
from tests.serving import running_server

HI = [{"role": "user", "content": "Hello"}]


def nested(depth: int) -> dict:
    """An object `depth` objects deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def tools(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "4096") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_tool_parameters_nested_700_deep_are_400_naming_tools(server, client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=HI, tools=tools(nested(700)), max_tokens=2,
                                           stream=stream)
        assert caught.value.body["param"] == "tools" and str(MAX_NESTING) in caught.value.body["message"]
    response = httpx.post(server + "/tokenize", json={"messages": HI, "tools": tools(nested(700))})
    assert response.status_code == 400 and str(MAX_NESTING) in response.json()["error"]["message"]


def test_history_and_template_kwargs_nested_too_deep_are_400_naming_their_field(client):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested(700)}}
    history = [*HI, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "x"}]
    for kwargs, param in (({"messages": history}, "messages"),
                          ({"messages": HI, "extra_body": {"chat_template_kwargs": nested(700)}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", max_tokens=2, **kwargs)
        assert caught.value.body["param"] == param


def test_a_deep_but_bounded_schema_is_served_and_the_server_stays_healthy(server, client):
    deep = tools(nested(MAX_NESTING - 4))  # tools > tool > function > parameters: the bound exactly
    response = client.chat.completions.create(model="tiny", messages=HI, tools=deep, max_tokens=2, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 2
    assert httpx.get(server + "/health").status_code == 200
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 2
