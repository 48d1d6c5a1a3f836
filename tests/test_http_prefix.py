"""The prefix cache through HTTP (`python -m server` on the tiny V4.1, the official openai client):
multi-turn chats report their reused history in usage.prompt_tokens_details.cached_tokens, tenants
with different cache_salt never share it, and /metrics counts the hits in tokens."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.serving import running_server
from tests.test_metrics import reported, value

NO_THINK = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}
THINK = {"chat_template_kwargs": {"thinking": True}, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "2048") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def prompt_length(server: str, messages: list[dict], extra: dict) -> int:
    return httpx.post(server + "/tokenize", json={"messages": messages, **extra}).json()["count"]


def chat(client, messages, extra, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                          extra_body=extra, **kwargs)


def test_second_turn_reuses_the_first_without_thinking(server, client):
    turn1 = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog, please."}]
    first = chat(client, turn1, NO_THINK)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    second = chat(client, turn2, NO_THINK)
    # the whole first prompt at least (the answer too when it re-tokenizes as it was generated)
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt_length(server, turn1, NO_THINK)
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_thinking_turns_reuse_the_history_before_the_dropped_reasoning(server, client):
    """The next turn renders the first answer as `</think>answer` (its reasoning dropped): the history
    matches up to the first turn's `<think>`, where the engine kept a state point."""
    turn1 = [{"role": "user", "content": "Bonjour le monde. How does compressed attention pool tokens?"}]
    first = chat(client, turn1, THINK)
    message = first.choices[0].message
    turn2 = turn1 + [{"role": "assistant", "content": message.content or "ok",
                      "reasoning_content": message.model_extra.get("reasoning_content") or ""},
                     {"role": "user", "content": "Thanks."}]
    second = chat(client, turn2, THINK)
    assert second.usage.prompt_tokens_details.cached_tokens == prompt_length(server, turn1, THINK) - 1


def test_the_same_prompt_again_is_served_from_the_cache(server, client):
    messages = [{"role": "user", "content": "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, once more."}]
    first, again = chat(client, messages, NO_THINK), chat(client, messages, NO_THINK)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy, same state
    streamed = list(chat(client, messages, NO_THINK, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens


def settled(server: str) -> dict:
    """A scrape once the engine's stats (sent every second) include every request finished so far."""
    reported(server)
    time.sleep(1.5)
    return reported(server)


def test_cache_salt_keeps_tenants_apart_and_metrics_count_hits(server, client):
    before = settled(server)
    messages = [{"role": "user", "content": "Hola mundo. Hallo Welt. Which tenant am I?"}]
    salted = [chat(client, messages, NO_THINK | {"cache_salt": salt}) for salt in ("tenant-a", "tenant-b")]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in salted] == [0, 0]
    again = chat(client, messages, NO_THINK | {"cache_salt": "tenant-a"})
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    after = settled(server)
    for prefix in ("ds4serve", "vllm"):
        hits = value(after, f"{prefix}:prefix_cache_hits_total", model_name="tiny") - value(before, f"{prefix}:prefix_cache_hits_total", model_name="tiny")
        queries = value(after, f"{prefix}:prefix_cache_queries_total", model_name="tiny") - value(before, f"{prefix}:prefix_cache_queries_total", model_name="tiny")
        assert hits == again.usage.prompt_tokens and queries == 3 * again.usage.prompt_tokens
    # nothing runs: the pages the cache keeps count as free, as vLLM counts them
    assert value(after, "ds4serve:kv_pages_cached", model_name="tiny") > 0
    assert value(after, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
