"""A completions call with a prompt list counts against the queue as the prompts x n requests it is
(issue 21, item 3): it is admitted whole or refused whole (429), never past `server.max_waiting`; a
call larger than the whole queue, or with more than `server.max_prompts_per_request` prompts, is a
400. Through a real server with the openai client, and on the Lifecycle itself."""

from __future__ import annotations

import httpx
import openai
import pytest

from contract.config import ServerSection
from server.lifecycle import CallTooLarge, Lifecycle, QueueFull
from tests.serving import running_server

MAX_PROMPTS = ServerSection().max_prompts_per_request


def test_lifecycle_admits_a_call_whole_or_not_at_all():
    lifecycle = Lifecycle(max_running=1, max_waiting=2, drain_timeout_s=1.0)
    with pytest.raises(CallTooLarge) as caught:
        lifecycle.admit(4, "prompt")  # idle, yet more than running + waiting: it could never fit
    assert caught.value.param == "prompt" and lifecycle.in_flight == 0
    first = lifecycle.admit(1)
    with pytest.raises(QueueFull):
        lifecycle.admit(3)  # one place runs, two wait: 1 + 3 - 1 > 2
    assert lifecycle.in_flight == 1
    second = lifecycle.admit(2)
    assert lifecycle.waiting == 2
    with pytest.raises(QueueFull):
        lifecycle.admit(1)
    first.release()
    second.release()
    assert lifecycle.in_flight == 0
    lifecycle.admit(3).release()  # the whole queue, when idle


# One running sequence and two waiting places: three requests at most.
@pytest.fixture(scope="module")
def small_queue(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-num-seqs", "1", "--max-model-len", "4096",
                        "--set", "server.max_waiting=2") as base:
        yield base


LONG = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}


def test_a_prompt_list_over_the_bound_is_400_naming_prompt(small_queue):
    client = openai.OpenAI(base_url=small_queue + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["x"] * (MAX_PROMPTS + 1), max_tokens=1)
    assert caught.value.body["param"] == "prompt" and "max_prompts_per_request" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[[5, 6]] * (MAX_PROMPTS + 1), max_tokens=1)
    assert caught.value.body["param"] == "prompt"


def test_a_call_larger_than_the_queue_is_400_even_when_idle(small_queue):
    client = openai.OpenAI(base_url=small_queue + "/v1", api_key="unused", max_retries=0)
    for prompt, n in ((["a", "b", "c", "d"], 1), (["a", "b"], 2)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=prompt, n=n, max_tokens=1)
        assert "at most 3" in caught.value.body["message"]
    assert len(client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=1).choices) == 3


def test_a_prompt_list_that_does_not_fit_the_free_places_is_429_as_a_whole(small_queue):
    url = small_queue + "/v1/completions"
    client = openai.OpenAI(base_url=small_queue + "/v1", api_key="unused", max_retries=0)
    with httpx.Client(timeout=60) as running, httpx.Client(timeout=60) as waiting, \
            running.stream("POST", url, json=LONG) as first:
        first_lines = first.iter_lines()
        next(first_lines)  # it runs: two waiting places are left
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=2)
        with waiting.stream("POST", url, json={**LONG, "prompt": ["a", "b"]}) as second:
            assert second.status_code == 200  # the two fit, and fill the queue
            refused = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            metrics = httpx.get(small_queue + "/metrics").text
            waiting_now = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_waiting")]
            assert all(float(line.split()[-1]) <= 2 for line in waiting_now), waiting_now
    assert httpx.get(small_queue + "/health").status_code == 200
    response = client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=2, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
