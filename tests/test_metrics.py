"""GET /metrics on a real server: per-request counters and histograms move as requests run, under both
`ds4serve:` and vLLM's names; engine gauges come back to zero after clients disconnect mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import running_server

MODEL = "metrics-v41"
PREFIXES = ("ds4serve", "vllm")


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, keyed by (sample name, labels)."""
    response = httpx.get(base + "/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return scrape_text(response.text)


def scrape_text(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum over the samples named `name` whose labels include `labels` (model_name always)."""
    wanted = {"model_name": MODEL, **labels}.items()
    matches = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    assert matches, f"no sample {name} {labels}"
    return sum(matches)


def reported(base: str, timeout: float = 10) -> dict[tuple[str, frozenset], float]:
    """A scrape taken once the engine has sent its first stats (about a second after it starts)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base)
        if any(name == "ds4serve:cache_config_info" for name, _ in samples):
            return samples
        assert time.monotonic() < deadline, "the engine never reported its stats"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], MODEL, "--max-num-seqs", "32") as base:
        yield base


def test_counters_and_histograms_move_under_both_prefixes(server):
    before = scrape(server)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    done = client.completions.create(model=MODEL, prompt="hello metrics", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model=MODEL, prompt="a streamed one", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    after = reported(server)
    prompt_tokens = done.usage.prompt_tokens + usage.prompt_tokens
    generated = done.usage.completion_tokens + usage.completion_tokens
    assert generated == 9

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for p in PREFIXES:
        assert moved(f"{p}:prompt_tokens_total") == prompt_tokens
        assert moved(f"{p}:generation_tokens_total") == generated
        assert moved(f"{p}:request_success_total", finished_reason="length") == 2
        assert moved(f"{p}:request_success_total", finished_reason="abort") == 0
        assert moved(f"{p}:time_to_first_token_seconds_count") == 2
        assert moved(f"{p}:inter_token_latency_seconds_count") == generated - 2  # one per later step
        assert moved(f"{p}:e2e_request_latency_seconds_count") == 2
        assert moved(f"{p}:e2e_request_latency_seconds_sum") >= moved(f"{p}:time_to_first_token_seconds_sum") > 0
        assert moved(f"{p}:request_generation_tokens_sum") == generated
        assert value(after, f"{p}:num_preemptions_total") == 0
        assert moved(f"{p}:prefix_cache_queries_total") == prompt_tokens  # looked up, in tokens
        assert moved(f"{p}:prefix_cache_hits_total") == 0  # the two prompts share only BOS
        info = [dict(ls) for (n, ls), v in after.items() if n == f"{p}:cache_config_info" and v == 1]
        assert len(info) == 1 and info[0]["block_size"] == "128" and int(info[0]["num_gpu_blocks"]) > 0
    assert moved("vllm:time_per_output_token_seconds_count") == generated - 2
    buckets = {dict(ls)["le"] for (n, ls) in after if n == "vllm:time_to_first_token_seconds_bucket"}
    assert {"0.001", "2560.0", "+Inf"} <= buckets  # vLLM's buckets


def test_disconnected_streams_leave_nothing_running_or_held(server):
    """Disconnecting 20 streaming clients mid-generation leaves zero running requests and zero held
    pages (read from /metrics)."""
    aborted_before = value(scrape(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1500, "stream": True, "ignore_eos": True}

    async def open_and_read(http: httpx.AsyncClient, release: asyncio.Event) -> None:
        async with http.stream("POST", server + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines, chunks = response.aiter_lines(), 0  # held: dropping the iterator would close the stream
            while chunks < 3:
                chunks += (await anext(lines)).startswith("data: ")
            await release.wait()  # then leaving the block closes the connection mid-generation

    async def loaded(http: httpx.AsyncClient) -> None:
        """Waits until /metrics shows all 20 running (the engine reports about once a second)."""
        while True:
            samples = scrape_text((await http.get(server + "/metrics")).text)
            if value(samples, "vllm:num_requests_running") == 20 and value(samples, "ds4serve:kv_pages_held") > 0:
                return
            await asyncio.sleep(0.2)

    async def run() -> None:
        release = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as http:
            streams = asyncio.gather(*(open_and_read(http, release) for _ in range(20)))
            await asyncio.wait_for(loaded(http), 30)
            release.set()
            await streams

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(server)
        figures = (
            value(samples, "ds4serve:num_requests_running"), value(samples, "vllm:num_requests_running"),
            value(samples, "ds4serve:kv_pages_held"), value(samples, "vllm:kv_cache_usage_perc"),
            value(samples, "vllm:request_success_total", finished_reason="abort") - aborted_before,
        )
        if figures == (0, 0, 0, 0, 20):
            break
        assert time.monotonic() < deadline, f"running, running, pages held, kv usage, aborts: {figures}"
        time.sleep(0.5)


def test_open_without_a_key_and_vllm_names_optional(checkpoints):
    with running_server(checkpoints["v41"], MODEL, "--api-key", "secret", "--set", "metrics.vllm_compat=false") as base:
        assert httpx.get(base + "/v1/models").status_code == 401
        names = {name for name, _ in scrape(base)}
    assert "ds4serve:num_requests_running" in names and "ds4serve:time_to_first_token_seconds_count" in names
    assert not any(name.startswith("vllm:") for name in names)


def test_a_stop_string_finish_counts_as_stop_not_abort(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    free = client.completions.create(model=MODEL, prompt="stop here", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    stop = free.choices[0].text[2:5]  # text the same greedy request is bound to produce
    before = scrape(server)
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt="stop here", max_tokens=12, temperature=0,
                                             stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            finish = [c.choices[0].finish_reason for c in response if c.choices and c.choices[0].finish_reason][-1]
        else:
            finish = response.choices[0].finish_reason
        assert finish == "stop"
    after = scrape(server)
    for prefix in ("ds4serve", "vllm"):
        name = f"{prefix}:request_success_total"
        assert value(after, name, finished_reason="stop") - value(before, name, finished_reason="stop") == 2
        assert value(after, name, finished_reason="abort") == value(before, name, finished_reason="abort")
