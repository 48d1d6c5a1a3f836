"""GET /metrics on a real server: per-request counters and histograms move as requests run, under both
`ds4serve:` and vLLM's names, with vLLM's buckets; the engine's queue / prefill / decode / inference
times add up; the process and GC collectors are there and no `*_created` series; engine gauges come
back to zero after clients disconnect mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.process import STATS_INTERVAL_S
from tests.serving import running_server

MODEL = "metrics-v41"
PREFIXES = ("ds4serve", "vllm")
# vLLM's buckets (vllm/v1/metrics/loggers.py), written out here as the spec
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N = (1, 2, 5, 10, 20)


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


def bounds(samples: dict, name: str) -> set[str]:
    """The `le` labels of histogram `name`'s buckets."""
    return {dict(ls)["le"] for (n, ls) in samples if n == f"{name}_bucket"}


def le(*edges: float) -> set[str]:
    return {str(float(edge)) for edge in edges} | {"+Inf"}


def settled(base: str, timeout: float = 20) -> dict[tuple[str, frozenset], float]:
    """A scrape once the engine is idle and its stats stopped changing over a report interval (the
    engine sends them only when they change), so later deltas hold nothing of earlier tests."""
    deadline = time.monotonic() + timeout
    last = reported(base)
    while True:
        time.sleep(STATS_INTERVAL_S + 0.3)
        samples = scrape(base)
        figures = [value(samples, name) for name in ("vllm:iteration_tokens_total_count", "vllm:num_requests_running",
                                                     "vllm:num_requests_waiting")]
        if figures[1:] == [0, 0] and figures[0] == value(last, "vllm:iteration_tokens_total_count"):
            return samples
        assert time.monotonic() < deadline, f"the engine never settled: {figures}"
        last = samples


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
    """The front end's counters move at once; the engine's (prefix cache queries, preemptions) arrive
    with its next stats report, so both scrapes wait for the engine to settle (the after-scrape once
    read the prefix queries of the first request only: 8 tokens of 13)."""
    before = settled(server)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    done = client.completions.create(model=MODEL, prompt="hello metrics", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model=MODEL, prompt="a streamed one", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    after = settled(server)
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


def test_engine_timings_request_params_and_step_tokens(server):
    """Two prompts with n=2 and one with n=1: the engine's queue / prefill / decode / inference times,
    per-request TPOT, n, max_tokens, the most tokens a prompt's choices made, prompt tokens by source
    and tokens per engine step, each in vLLM's buckets and consistent with the front end's latencies."""
    before = settled(server)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    paired = client.completions.create(model=MODEL, prompt=["timing one", "timing two"], n=2, max_tokens=6,
                                       temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    single = client.completions.create(model=MODEL, prompt="timing three", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert len(paired.choices) == 4
    generated = paired.usage.completion_tokens + single.usage.completion_tokens
    assert generated == 4 * 6 + 3
    requests = 5

    def moved(samples: dict, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    # the engine computed every prompt token not cached, then fed back each generated token but the last
    computed = moved(scrape(server), "vllm:prompt_tokens_by_source_total", source="local_compute")
    deadline = time.monotonic() + 10
    while True:  # the engine's stats arrive about once a second
        after = scrape(server)
        step_tokens = moved(after, "vllm:iteration_tokens_total_sum")
        if step_tokens == computed + generated - requests:
            break
        assert time.monotonic() < deadline, f"tokens per step add up to {step_tokens}"
        time.sleep(0.2)

    for p in PREFIXES:
        assert moved(after, f"{p}:iteration_tokens_total_sum") == step_tokens
        assert moved(after, f"{p}:iteration_tokens_total_count") >= 6  # a step per decode token at least
        assert bounds(after, f"{p}:iteration_tokens_total") == le(*STEP_TOKENS)
        assert moved(after, f"{p}:num_preemptions_total") == 0
        phases = {}
        for phase in ("queue", "prefill", "decode", "inference"):
            name = f"{p}:request_{phase}_time_seconds"
            assert moved(after, f"{name}_count") == requests
            assert bounds(after, name) == le(*REQUEST_LATENCY)
            phases[phase] = moved(after, f"{name}_sum")
        assert phases["queue"] >= 0 and phases["prefill"] > 0 and phases["decode"] > 0
        assert phases["prefill"] + phases["decode"] == pytest.approx(phases["inference"], abs=1e-6)
        # the engine's view lies inside the front end's: arrival to first token within TTFT, and so on
        assert phases["queue"] + phases["prefill"] <= moved(after, f"{p}:time_to_first_token_seconds_sum")
        assert phases["queue"] + phases["inference"] <= moved(after, f"{p}:e2e_request_latency_seconds_sum")
        tpot = f"{p}:request_time_per_output_token_seconds"
        assert moved(after, f"{tpot}_count") == requests and bounds(after, tpot) == le(*PER_TOKEN)
        # decode time over the tokens after the first: 5 of them for four requests, 2 for one
        assert phases["decode"] / 5 <= moved(after, f"{tpot}_sum") <= phases["decode"] / 2

        n = f"{p}:request_params_n"
        assert moved(after, f"{n}_count") == 3 and moved(after, f"{n}_sum") == 2 + 2 + 1  # once per prompt
        assert moved(after, f"{n}_bucket", le="1.0") == 1 and moved(after, f"{n}_bucket", le="2.0") == 3
        assert bounds(after, n) == le(*N)
        max_tokens = f"{p}:request_params_max_tokens"
        assert moved(after, f"{max_tokens}_count") == requests and moved(after, f"{max_tokens}_sum") == 4 * 6 + 3
        assert moved(after, f"{max_tokens}_bucket", le="5.0") == 1
        assert moved(after, f"{max_tokens}_bucket", le="10.0") == 5
        assert "1.0" in bounds(after, max_tokens) and "+Inf" in bounds(after, max_tokens)
        most = f"{p}:request_max_num_generation_tokens"
        assert moved(after, f"{most}_count") == 3 and moved(after, f"{most}_sum") == 6 + 6 + 3

        prompt_tokens = moved(after, f"{p}:prompt_tokens_total")
        cached = moved(after, f"{p}:prompt_tokens_by_source_total", source="local_cache_hit")
        assert moved(after, f"{p}:prompt_tokens_by_source_total", source="local_compute") == computed
        assert computed + cached == prompt_tokens == moved(after, f"{p}:request_prompt_tokens_sum")
        assert moved(after, f"{p}:prompt_tokens_cached_total") == cached
        kv = f"{p}:request_prefill_kv_computed_tokens"
        assert moved(after, f"{kv}_count") == requests and moved(after, f"{kv}_sum") == computed


def test_process_collectors_and_no_created_series(server):
    response = httpx.get(server + "/metrics", timeout=10)
    names = {sample.name for family in text_string_to_metric_families(response.text) for sample in family.samples}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info",
                 "python_gc_objects_collected_total", "python_gc_collections_total"):
        assert name in names
    assert not [name for name in names if name.endswith("_created")]
    assert "_created" not in response.text


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
        # cut in the front end, the requests still have the engine's times up to their last tokens
        for phase in ("queue", "decode", "inference"):
            name = f"{prefix}:request_{phase}_time_seconds_count"
            assert value(after, name) - value(before, name) == 2
