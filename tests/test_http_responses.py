"""POST /v1/responses, GET /v1/responses/{id} and GET /v1/models/{id} through real HTTP (`python -m
server` on the tiny V4.1 checkpoint) with the official openai client: the Responses request runs on
the chat path, so each answer is checked against the chat completion or the rendered chat prompt of
the same conversation; reasoning and a DSML tool call are forced through the real engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from models.config import ModelConfig
from server.tokenizer import TextTokenizer
from tests.serving import DSML_CALL, running_dsml_server, running_server

HELLO = "Hello, how are you?"
THINK_END = 6  # the tiny tokenizer's </think>
NO_THINK = {"reasoning": {"effort": "none"}}
GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 8, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "2048") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return TextTokenizer(checkpoints["v41"], ModelConfig.from_file(checkpoints["v41"] / "config.json").bos_token_id)


def prompt_length(server: str, messages: list[dict], **extra) -> int:
    """The length of the chat path's prompt for `messages` (vLLM's /tokenize renders them)."""
    return len(httpx.post(server + "/tokenize", json={"messages": messages, **extra}).json()["tokens"])


def as_input(items) -> list[dict]:
    """Output items sent back as input items, as a client echoes them."""
    return [item.model_dump(exclude_none=True) for item in items]


def test_a_plain_round_trip_is_the_chat_completion(server, client):
    response = client.responses.create(input=HELLO, **GREEDY, **NO_THINK)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": HELLO}], temperature=0,
                                          max_tokens=8, reasoning_effort="none", extra_body={"ignore_eos": True})
    assert response.output_text == chat.choices[0].message.content
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == prompt_length(server, [{"role": "user", "content": HELLO}],
                                                                            reasoning_effort="none")
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert response.temperature == 0 and response.max_output_tokens == 8 and response.tools == []


def test_a_stored_response_is_retrieved_and_store_false_keeps_none(client):
    response = client.responses.create(input=HELLO, **GREEDY, **NO_THINK, metadata={"run": "7"})
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert response.metadata == {"run": "7"}
    unkept = client.responses.create(input=HELLO, store=False, **GREEDY, **NO_THINK)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="And?", previous_response_id=unkept.id, **GREEDY)
    assert refused.value.body["param"] == "previous_response_id"


def test_streamed_events_build_the_same_response(client):
    whole = client.responses.create(input=HELLO, **GREEDY, **NO_THINK)
    with client.responses.stream(input=HELLO, **GREEDY, **NO_THINK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == whole.usage.input_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_instructions_are_a_system_message(client):
    asked = client.responses.create(instructions="Answer briefly.", input=HELLO, **GREEDY, **NO_THINK)
    spelled = client.responses.create(input=[{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": [{"type": "input_text", "text": HELLO}]}],
                                      **GREEDY, **NO_THINK)
    plain = client.responses.create(input=HELLO, **GREEDY, **NO_THINK)
    assert asked.instructions == "Answer briefly." and asked.usage.input_tokens > plain.usage.input_tokens
    assert (asked.usage.input_tokens, asked.output_text) == (spelled.usage.input_tokens, spelled.output_text)


def test_previous_response_id_continues_the_conversation_without_its_instructions(server, client):
    first = client.responses.create(instructions="Answer briefly.", input=HELLO, **GREEDY, **NO_THINK)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **GREEDY, **NO_THINK)
    spelled = client.responses.create(input=[{"role": "user", "content": HELLO}, *as_input(first.output),
                                             {"role": "user", "content": "And then?"}], **GREEDY, **NO_THINK)
    assert second.previous_response_id == first.id
    first_turn = prompt_length(server, [{"role": "user", "content": HELLO}], reasoning_effort="none")
    assert second.usage.input_tokens > first_turn + 4  # the first turn, its answer, the new question
    assert (second.usage.input_tokens, second.output_text) == (spelled.usage.input_tokens, spelled.output_text)


def test_a_function_call_output_is_rendered_as_the_chat_tool_result(server, client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}
    response = client.responses.create(input=[{"role": "user", "content": "Weather in Oslo?"}, call, result],
                                       tools=[WEATHER], **GREEDY)
    assert response.status in ("completed", "incomplete") and response.tools[0].name == "get_weather"
    chat_messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    assert response.usage.input_tokens == prompt_length(server, chat_messages, tools=[CHAT_WEATHER])


def test_a_forced_tool_choice_gets_the_chat_path_answer(server):
    """tool_choice "required" and a named function pass through to the chat path: its answer (a 400
    naming tool_choice while it does not constrain decoding) is the Responses answer too."""
    for responses_choice, chat_choice in [("required", "required"),
                                          ({"type": "function", "name": "get_weather"},
                                           {"type": "function", "function": {"name": "get_weather"}})]:
        chat = httpx.post(server + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather?"}], "tools": [CHAT_WEATHER], "tool_choice": chat_choice,
            "max_tokens": 4})
        answer = httpx.post(server + "/v1/responses", json={
            "input": "Weather?", "tools": [WEATHER], "tool_choice": responses_choice, "max_output_tokens": 4})
        assert answer.status_code == chat.status_code, answer.text
        if chat.status_code == 400:
            assert answer.json()["error"]["param"] == chat.json()["error"]["param"] == "tool_choice"


def test_reasoning_effort_turns_thinking_on_and_off(client):
    kept_thinking = {**GREEDY, "extra_body": {"ignore_eos": True, "logit_bias": {str(THINK_END): -100}}}
    thinking = client.responses.create(input=HELLO, reasoning={"effort": "high"}, **kept_thinking)
    [reasoning] = thinking.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert thinking.output_text == "" and thinking.reasoning.effort == "high"
    assert thinking.usage.output_tokens_details.reasoning_tokens == thinking.usage.output_tokens == 8
    plain = client.responses.create(input=HELLO, **GREEDY, **NO_THINK)
    assert [item.type for item in plain.output] == ["message"]
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    assert plain.usage.input_tokens != thinking.usage.input_tokens  # the effort is part of the prompt


def test_forced_reasoning_then_text_streams_as_two_items(server, client, tokenizer):
    """Distinct tokens forced in order (descending logit_bias, and a repetition penalty that sinks a
    token once drawn and every prompt token): two of reasoning, </think>, one of text."""
    prompt = set(httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": HELLO}]}).json()["tokens"])
    plain = [i for i in range(7, tokenizer.vocab_size) if i not in prompt and tokenizer.token_text(i).isalpha()]
    target = [plain[0], plain[1], THINK_END, plain[2]]
    extra = {"logit_bias": {str(t): 100.0 - 10 * k for k, t in enumerate(target)}, "repetition_penalty": 1e6,
             "ignore_eos": True}
    body = dict(model="tiny", input=HELLO, temperature=0, max_output_tokens=4, extra_body=extra)
    whole = client.responses.create(**body)
    reasoning, message = whole.output
    assert reasoning.content[0].text == tokenizer.decode(target[:2]) and message.type == "message"
    assert whole.output_text == tokenizer.decode(target[3:])
    assert whole.usage.output_tokens_details.reasoning_tokens == 2
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [streamed]
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == 2


@pytest.fixture(scope="module")
def dsml_server(tmp_path_factory):
    with running_dsml_server(tmp_path_factory.mktemp("dsml")) as served:
        yield served


def test_a_forced_function_call_round_trip(dsml_server):
    """Reasoning, </think>, a DSML call, then EOS, forced through the real engine (as in
    test_http_chat.py): the call is a function_call item, streamed as its arguments' events; its
    output sent back with previous_response_id renders as the chat path's tool result."""
    base, tokenizer = dsml_server
    target = [tokenizer.encode(DSML_CALL[0], add_special_tokens=False)[0], THINK_END]
    target += [tokenizer.encode(text, add_special_tokens=False)[0] for text in DSML_CALL[1:]] + [1]
    bias = {str(token): 100.0 - 0.35 * k for k, token in enumerate(target)}
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    body = dict(model="tiny", input="Weather?", tools=[WEATHER], reasoning={"effort": "high"}, temperature=0,
                max_output_tokens=20, extra_body={"logit_bias": bias, "presence_penalty": 2.0, "frequency_penalty": 2.0})
    response = client.responses.create(**body)
    reasoning, call = response.output
    assert response.status == "completed" and reasoning.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("chatcmpl-tool-")
    assert response.usage.output_tokens == len(target) and response.usage.output_tokens_details.reasoning_tokens == 1

    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["reasoning", "function_call"] and added[1].name == "get_weather"
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(fragments) == json.loads(done.arguments) == {"city": "Oslo"}
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.call_id == added[1].call_id and json.loads(streamed_call.arguments) == {"city": "Oslo"}

    answered = client.responses.create(
        model="tiny", previous_response_id=response.id, tools=[WEATHER], temperature=0, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    chat_messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning": "Let me check.", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]
    tokens = httpx.post(base + "/tokenize", json={"messages": chat_messages, "tools": [CHAT_WEATHER]}).json()["tokens"]
    assert answered.usage.input_tokens == len(tokens)


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k": "\ud800"}}, "metadata.k"),  # a lone surrogate, which JSON escapes admit
    ({"model": "gpt-4o"}, None),
])
def test_unsupported_or_wrong_fields_are_a_400_naming_the_field(server, extra, param):
    response = httpx.post(server + "/v1/responses", content=json.dumps({"input": HELLO, "max_output_tokens": 2, **extra}),
                          headers={"content-type": "application/json"})
    if extra.get("model"):
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400, error


def test_the_sdk_raises_the_400(client):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="tiny", input=HELLO, background=True)


def test_models_retrieve(server, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    error = httpx.get(server + "/v1/models/org/gpt-4o").json()["error"]
    assert error["type"] == "not_found_error" and error["code"] == 404 and "'org/gpt-4o'" in error["message"]
    assert httpx.get(server + "/v1/responses/resp_nothing").status_code == 404
