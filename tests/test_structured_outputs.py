"""Structured outputs through the real server and the official `openai` client, on the random tiny
models: the grammar (xgrammar, compiled in the engine), not the model, guarantees the shape. Schemas
here bound every value (enums, integer ranges, string lengths), so a random model's output ends
within max_tokens; each is checked against the schema it was asked for."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serving import running_server

pytest.importorskip("xgrammar")

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model would pad JSON with whitespace
NO_THINK = {"chat_template_kwargs": {"thinking": False}} | COMPACT
ASK = [{"role": "user", "content": "Give me the weather."}]


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    degrees: int = Field(ge=-30, le=45)
    sky: Literal["clear", "rain"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "2048") as base:
        yield base


@pytest.fixture(scope="module")
def v4_server(checkpoints):
    with running_server(checkpoints["mixed"], "tiny", "--max-model-len", "2048") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def think(checkpoints):
    """Thinking on, with `</think>` favoured so the random model's reasoning ends soon."""
    from models import ModelConfig
    from server.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(checkpoints["v41"], ModelConfig.from_file(checkpoints["v41"] / "config.json").bos_token_id)
    (think_end,) = tokenizer.encode("</think>", add_special_tokens=False)
    return {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(think_end): 6.0}} | COMPACT


def _weather_ok(value: dict) -> None:
    assert set(value) == {"city", "degrees", "sky"}
    Weather.model_validate(value)


@pytest.mark.parametrize("thinking", [False, True])
def test_parse_returns_an_object_that_validates(client, think, thinking):
    """`client.chat.completions.parse` with a pydantic model (strict json_schema); with thinking on the
    grammar starts after the reasoning."""
    completion = client.chat.completions.parse(
        model="tiny", messages=ASK, response_format=Weather, max_completion_tokens=400, temperature=0,
        extra_body=think if thinking else NO_THINK,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Weather)
    _weather_ok(json.loads(message.content))


def test_parse_streamed(client):
    with client.chat.completions.stream(
        model="tiny", messages=ASK, response_format=Weather, max_completion_tokens=400, temperature=0.8, seed=3,
        extra_body=NO_THINK,
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Weather)


@pytest.mark.parametrize("seed", [0])
def test_json_object_is_valid_json(client, seed):
    completion = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, max_completion_tokens=600,
        temperature=0.7, seed=seed, extra_body=NO_THINK,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":  # a random model may write a long object; the prefix is still JSON
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": "[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
    ("guided_regex", r"(yes|no)\.", lambda t: re.fullmatch(r"(yes|no)\.", t)),
    ("structured_outputs", {"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
    ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("structured_outputs", {"grammar": 'root ::= "A" digit digit\ndigit ::= [0-9]'}, lambda t: re.fullmatch("A[0-9]{2}", t)),
    ("guided_grammar", 'root ::= ("x" | "y")+ "!"', lambda t: re.fullmatch("[xy]+!", t) and len(t) < 200),
])
@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_outputs_match(client, field, value, check, stream):
    kwargs = dict(model="tiny", messages=ASK, max_completion_tokens=120, temperature=0.9, seed=7,
                  extra_body=NO_THINK | {field: value})
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert check(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_constraint_field(client, stream):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}},
              lambda t: _weather_ok(json.loads(t))),
             ({"structured_outputs": {"choice": ["red", "green"], "disable_any_whitespace": True}},
              lambda t: t in ("red", "green") or pytest.fail(t)),
             ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
              lambda t: isinstance(json.loads(t)["ok"], bool))]
    for extra, check in cases:
        kwargs = dict(model="tiny", prompt="The answer:", max_tokens=300, temperature=0, extra_body=COMPACT | extra)
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
        else:
            text = client.completions.create(**kwargs).choices[0].text
        check(text)


@pytest.mark.parametrize("thinking, stream", [(False, False), (True, True)])
def test_a_named_tool_choice_parses_into_that_call(client, think, thinking, stream):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], max_completion_tokens=400,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
                  extra_body=think if thinking else NO_THINK)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert len(calls) == 1
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        name, arguments = choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7


def test_required_tool_choice_calls_one_of_the_tools(client):
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=0.8,
        seed=5, max_completion_tokens=500, extra_body=NO_THINK | {"parallel_tool_calls": False},
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    else:
        assert call.function.name == "get_time" and args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


def test_the_v4_dialect_forces_its_own_call_syntax(v4_server):
    client = openai.OpenAI(base_url=v4_server + "/v1", api_key="unused", max_retries=0)
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0, max_completion_tokens=300, extra_body=NO_THINK,
    ).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"nonsense": 1}}, "structured_outputs"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]}, "tool_choice"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_be_used_is_a_400_naming_its_field(server, extra, param, stream):
    """Before any stream starts; the server stays up."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 5, "stream": stream, **extra}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(server + "/health").status_code == 200


def test_allowed_token_ids_and_bad_words(client, checkpoints):
    from models import ModelConfig
    from server.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(checkpoints["v41"], ModelConfig.from_file(checkpoints["v41"] / "config.json").bos_token_id)
    base = dict(model="tiny", prompt="Once upon", max_tokens=24, temperature=0)

    def ids_of(**extra) -> list[int]:
        choice = client.completions.create(**base, extra_body={"return_token_ids": True, **extra}).choices[0]
        return choice.model_extra["token_ids"]

    free = ids_of()
    allowed = sorted(set(free[1:4]) | {7, 9})
    assert set(ids_of(allowed_token_ids=allowed)) <= set(allowed)
    # words of the free run that tokenize back to their own ids: one of one token, one of two
    words = {}
    for length in (1, 2):
        for start in range(len(free) - length + 1):
            text = tokenizer.decode(free[start:start + length])
            if text.strip() and tokenizer.encode(text.lstrip(), add_special_tokens=False) == free[start:start + length]:
                words[length] = (text.lstrip(), free[start:start + length])
                break
    assert set(words) == {1, 2}, words
    single, pair = words[1], words[2]
    banned = ids_of(bad_words=[single[0], pair[0]])
    assert single[1][0] not in banned
    assert all(banned[i:i + 2] != pair[1] for i in range(len(banned) - 1))
    assert banned != free


def test_constrained_and_free_requests_share_a_batch(client):
    """Concurrent requests: the constrained ones match, the free ones are what they are alone."""
    from concurrent.futures import ThreadPoolExecutor

    def free() -> str:
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0).choices[0].text

    def constrained() -> str:
        return client.chat.completions.create(
            model="tiny", messages=ASK, max_completion_tokens=60, temperature=0,
            extra_body=NO_THINK | {"structured_outputs": {"regex": "[0-9]{4}"}}).choices[0].message.content

    alone = free()
    with ThreadPoolExecutor(6) as pool:
        results = [pool.submit(fn) for fn in (free, constrained) * 3]
    texts = [r.result() for r in results]
    assert texts[0::2] == [alone] * 3
    assert all(re.fullmatch("[0-9]{4}", t) for t in texts[1::2])


def test_responses_round_trip_with_a_forced_function_call(client):
    """The Responses API over the same grammar: a forced call comes back as a function_call item whose
    arguments follow the schema; its result goes back with previous_response_id and gets an answer."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
                                    reasoning={"effort": "none"})
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[tool], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
        reasoning={"effort": "none"},
    )
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_text_format_json_schema(client):
    response = client.responses.create(
        # the Responses API has no whitespace option: a seeded draw that closes the object early
        model="tiny", input="Weather?", temperature=0.7, max_output_tokens=600, reasoning={"effort": "none"},
        extra_body={"seed": 0},
        text={"format": {"type": "json_schema", "name": "weather", "schema": Weather.model_json_schema(), "strict": True}},
    )
    _weather_ok(json.loads(response.output_text))
