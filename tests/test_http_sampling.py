"""Sampling parameters through real HTTP (the official openai client against `python -m server` on the
tiny V4.1 checkpoint): stop strings, logit_bias, min_tokens, penalties, and their 400s."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

from contract import NewRequest, RequestOutput, SamplingParams
from server.completions import IncrementalText, collect, stream_completion
from server.engine_client import EngineClient
from server.protocol import CompletionRequest
from tests.serving import CharTokenizer, FakeEngine, running_server

PROMPT = "Hello world"
EOS = 1  # the tiny checkpoint's eos_token_id


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "512") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def complete(client, max_tokens: int = 30, **extra):
    return client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )


@pytest.fixture(scope="module")
def greedy_text(client) -> str:
    return complete(client).choices[0].text


def a_stop_string(text: str) -> str:
    """Three letters from the middle of the greedy text (the tiny model's text is mostly byte noise)."""
    for start in range(4, len(text) - 3):
        if text[start : start + 3].isalpha() and text[start : start + 3].isascii():
            return text[start : start + 3]
    pytest.skip("the greedy text has no three ASCII letters in a row")


def test_incremental_text_holds_back_possible_stop_strings_and_cuts_at_the_first():
    text = IncrementalText(CharTokenizer(), stop=("abc", "bd!"))
    deltas = [text.push((ord(c),), final=False) for c in "xabdab"]
    assert deltas == ["x", "", "", "a", "bd", ""] and not text.stopped  # "a", "ab", "bd", "a", "ab" wait
    assert text.push((ord("c"),), final=False) == "" and text.stopped and text.sent == "xabd"
    tail = IncrementalText(CharTokenizer(), stop=("abc",))
    assert [tail.push((ord(c),), final=c == "b") for c in "xab"] == ["x", "", "ab"]  # flushed at the end


async def play(client: EngineClient, request_id: str, text: str) -> None:
    """Delivers one output per character (token id = code point), yielding to the loop in between."""
    for char in text:
        await asyncio.sleep(0.01)
        client.on_outputs([RequestOutput(request_id, new_token_ids=(ord(char),))])


def connected() -> tuple[EngineClient, FakeEngine]:
    client, engine = EngineClient(), FakeEngine()
    client.connect(engine)
    client.bind_loop(asyncio.get_running_loop())
    return client, engine


def test_collect_ends_at_a_stop_string_and_aborts_the_engine_request():
    async def run():
        client, engine = connected()
        request = NewRequest("r", [5], SamplingParams(max_tokens=10))
        player = asyncio.create_task(play(client, "r", "abcdef"))
        (generation,) = await collect(client.call([request]), [IncrementalText(CharTokenizer(), ("cd",))])
        await player
        return generation, engine.aborted

    generation, aborted = asyncio.run(run())
    assert generation.text == "ab" and generation.finish_reason == "stop"
    assert generation.token_ids == [ord(c) for c in "abcd"] and aborted == ["r"]


def test_stream_ends_a_choice_at_a_stop_string_and_aborts_its_engine_request_at_once():
    async def run():
        client, engine = connected()
        body = CompletionRequest(prompt=[5], max_tokens=10, stream=True, stop=["cd"])
        requests = [NewRequest("r", [5], SamplingParams()), NewRequest("s", [5], SamplingParams())]
        players = [asyncio.create_task(play(client, "r", "abcdef")), asyncio.create_task(play(client, "s", "x" * 20))]
        texts, aborted_while_open = {0: "", 1: ""}, None
        async for frame in stream_completion(body, "cmpl-r", client.call(requests), CharTokenizer(), "tiny"):
            if frame == b"data: [DONE]\n\n":
                break
            choice = orjson.loads(frame[len(b"data: "):])["choices"][0]
            texts[choice["index"]] += choice["text"]
            if choice["index"] == 0 and choice.get("finish_reason") == "stop":
                await asyncio.sleep(0.05)
                aborted_while_open = list(engine.aborted)  # choice 1 still streams
                await players[1]
                client.on_outputs([RequestOutput("s", finished=True, finish_reason="length")])
        return texts, aborted_while_open

    texts, aborted_while_open = asyncio.run(run())
    assert texts == {0: "ab", 1: "x" * 20} and aborted_while_open == ["r"]


def test_stop_string_cuts_the_text_and_ends_the_request(client, greedy_text):
    stop = a_stop_string(greedy_text)
    response = complete(client, stop=stop)
    choice = response.choices[0]
    assert choice.text == greedy_text[: greedy_text.find(stop)] and stop not in choice.text
    assert choice.finish_reason == "stop"
    assert response.usage.completion_tokens < 30  # the engine request ended at the stop string
    never = complete(client, stop=["\x00never", "neverever"])
    assert never.choices[0].text == greedy_text and never.choices[0].finish_reason == "length"


def test_streamed_stop_string_sends_nothing_past_it(client, greedy_text):
    stop = a_stop_string(greedy_text)
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, stop=["\x00never", stop], extra_body={"ignore_eos": True},
    ))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == greedy_text[: greedy_text.find(stop)]
    assert [c.finish_reason for c in choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens < 30


def test_streamed_text_held_back_for_a_possible_stop_string_is_flushed_at_the_end(client, greedy_text):
    stop = a_stop_string(greedy_text)
    almost = stop + "\x00"  # its start matches, the whole never does
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True, stop=almost,
        extra_body={"ignore_eos": True},
    ))
    assert "".join(c.choices[0].text for c in chunks) == greedy_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token_and_logprobs_stay_the_models(client):
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.token_ids == [42] * 5
    assert all(lp < -0.5 for lp in choice.logprobs.token_logprobs)  # raw, not the biased distribution


def test_min_tokens_holds_off_eos(client):
    eager = complete(client, ignore_eos=False, logit_bias={str(EOS): 100})
    assert eager.choices[0].token_ids == [EOS] and eager.choices[0].finish_reason == "stop"
    held = complete(client, ignore_eos=False, logit_bias={str(EOS): 100}, min_tokens=5).choices[0]
    assert len(held.token_ids) == 6 and EOS not in held.token_ids[:5] and held.token_ids[5] == EOS
    assert held.finish_reason == "stop"
    stop_id = complete(client, logit_bias={"42": 100}, stop_token_ids=[42], min_tokens=3).choices[0]
    assert len(stop_id.token_ids) == 4 and 42 not in stop_id.token_ids[:3] and stop_id.finish_reason == "stop"


def test_penalties_are_accepted_and_change_greedy_output(client):
    plain = complete(client).choices[0].token_ids
    assert len(set(plain)) < len(plain), "the test needs a greedy output that repeats a token"
    for penalty in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.5}):
        penalized = complete(client, **penalty).choices[0].token_ids
        assert penalized != plain, penalty
        assert len(set(penalized)) > len(set(plain)), penalty


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 21, "echo": True}, "logprobs"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"logit_bias": {"token": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop_token_ids": [600]}, "stop_token_ids"),
])
def test_bad_sampling_parameters_are_400_with_openai_error_body(server, body, param):
    for stream in (False, True):
        response = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": stream, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
        assert error["param"].startswith(param), error
