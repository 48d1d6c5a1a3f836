"""Prometheus metrics at GET /metrics, under `ds4serve:` and, for tools written for vLLM, `vllm:`.

The vLLM names, labels (`model_name`, `engine`), buckets and help texts are those of vLLM's V1
Prometheus logger (vllm/v1/metrics/loggers.py), so its dashboards and benchmark clients read this server
unchanged; like vLLM, the exposition has the process and Python collectors and no `*_created` series.
Engine figures (requests, pages, preemptions, tokens per step, the prefix cache's tiers, Engram's) are
read from the engine's latest stats at scrape time; per-request figures (latencies, tokens, finish
reasons, parameters) are recorded as an EngineCall hands outputs to the HTTP code. The queue, prefill,
decode and inference times are the engine's own durations (RequestOutput.queue_time_s /
inference_time_s), as vLLM measures them in its engine core. Each app gets its own registry, so several
apps can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from contract import (
    PREFETCH_WAIT_BUCKETS,
    STEP_TOKEN_BUCKETS,
    EngineStats,
    EngramStats,
    ExpertOffloadStats,
    NewRequest,
    RequestOutput,
)
from server.engine_client import EngineCall, EngineClient, RequestObserver

LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine per server; the label is kept so vLLM's queries match
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PROMPT_SOURCES = ("local_compute", "local_cache_hit")  # vLLM's third, external_kv_transfer, needs a KV connector


@dataclass(frozen=True)
class MetricsSetup:
    model_name: str
    max_model_len: int  # the top of the token-count buckets
    block_size: int  # tokens per KV page (scheduler.block_tokens)
    vllm_compat: bool = True

    @property
    def prefixes(self) -> tuple[str, ...]:
        return ("ds4serve", "vllm") if self.vllm_compat else ("ds4serve",)


def install_metrics(app: FastAPI, engine: EngineClient, setup: MetricsSetup) -> None:
    """Adds GET /metrics (left open by the auth middleware) and starts recording every request."""
    disable_created_metrics()  # prometheus-client's switch is process-wide; vLLM turns it off the same way
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    registry.register(EngineCollector(engine, setup))
    metrics = RequestMetrics(registry, setup)
    engine.observe = lambda call: trace_call(metrics, call)

    @app.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def token_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_value: 1, 2, 5, 10, 20, 50, ..."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class Fanout:
    """One figure recorded under every prefix at once (children: bound prometheus-client metrics)."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class RequestMetrics:
    """Per-request counters and histograms; thread-safe (prometheus-client locks each child)."""

    def __init__(self, registry: CollectorRegistry, setup: MetricsSetup) -> None:
        self.setup, self.registry = setup, registry
        tokens = token_buckets(setup.max_model_len)
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        by_source = [
            Counter(f"{p}:prompt_tokens_by_source", "Number of prompt tokens by source.", [*LABELS, "source"],
                    registry=registry)
            for p in setup.prefixes
        ]
        self.prompt_tokens_by_source = {
            source: Fanout([c.labels(setup.model_name, ENGINE, source) for c in by_source])
            for source in PROMPT_SOURCES
        }
        self.prompt_tokens_cached = self._counter("prompt_tokens_cached",
                                                  "Number of cached prompt tokens (local + external).")
        success = [
            Counter(f"{p}:request_success", "Count of successfully processed requests.", [*LABELS, "finished_reason"],
                    registry=registry)
            for p in setup.prefixes
        ]
        self.success = {r: Fanout([c.labels(setup.model_name, ENGINE, r) for c in success]) for r in FINISH_REASONS}
        self.ttft = self._histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                   ITL_BUCKETS)
        if setup.vllm_compat:  # vLLM's older name for the same figure, still queried by older dashboards
            self.itl = Fanout(self.itl.children + self._histogram(
                "time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS,
                ("vllm",)).children)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                   REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                                     tokens)
        self.request_generation_tokens = self._histogram("request_generation_tokens",
                                                         "Number of generation tokens processed.", tokens)
        self.request_tpot = self._histogram("request_time_per_output_token_seconds",
                                            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds",
                                          "Histogram of time spent in WAITING phase for request.",
                                          REQUEST_LATENCY_BUCKETS)
        self.prefill_time = self._histogram("request_prefill_time_seconds",
                                            "Histogram of time spent in PREFILL phase for request.",
                                            REQUEST_LATENCY_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds",
                                           "Histogram of time spent in DECODE phase for request.",
                                           REQUEST_LATENCY_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds",
                                              "Histogram of time spent in RUNNING phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.prefill_kv_computed = self._histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.max_num_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            tokens)
        self.params_n = self._histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = self._histogram("request_params_max_tokens",
                                                 "Histogram of the max_tokens request parameter.", tokens)

    def _counter(self, name: str, doc: str) -> Fanout:
        return Fanout([
            Counter(f"{p}:{name}", doc, LABELS, registry=self.registry).labels(self.setup.model_name, ENGINE)
            for p in self.setup.prefixes
        ])

    def _histogram(self, name: str, doc: str, buckets: Sequence[float], prefixes: tuple[str, ...] = ()) -> Fanout:
        """Under `prefixes`, or under every prefix when none is named."""
        return Fanout([
            Histogram(f"{p}:{name}", doc, LABELS, registry=self.registry, buckets=buckets)
            .labels(self.setup.model_name, ENGINE)
            for p in prefixes or self.setup.prefixes
        ])


def trace_call(metrics: RequestMetrics, call: EngineCall) -> list[RequestTrace]:
    """One trace per request of the call; each prompt's n choices (consecutive requests) share a PromptTrace."""
    prompts = [PromptTrace(metrics, len(call.requests[i : i + call.n])) for i in range(0, len(call.requests), call.n)]
    return [RequestTrace(metrics, request, prompts[i // call.n]) for i, request in enumerate(call.requests)]


class PromptTrace:
    """One prompt's n choices. vLLM records n, and the most tokens one of its choices generated, once per
    prompt, when its last choice ends."""

    def __init__(self, metrics: RequestMetrics, n: int) -> None:
        self.metrics, self.n, self.open = metrics, n, n
        self.most_tokens = 0

    def choice_ended(self, num_tokens: int) -> None:
        self.most_tokens, self.open = max(self.most_tokens, num_tokens), self.open - 1
        if not self.open:
            self.metrics.params_n.observe(self.n)
            self.metrics.max_num_generation_tokens.observe(self.most_tokens)


class RequestTrace(RequestObserver):
    """One request's timing: TTFT from the start of generate() to the first output carrying tokens,
    inter-token latency between later such outputs (one per engine step, as vLLM counts it), e2e at the
    end. A caller that leaves early (client gone, stop string cut in the front end) ends it as "abort".
    Queue, prefill, decode and inference times are the engine's: queue and prefill from the output with
    the first tokens, inference from the last output seen (so a request cut in the front end has them
    too), decode the difference; a request that got no token has none of them."""

    def __init__(self, metrics: RequestMetrics, request: NewRequest, prompt: PromptTrace) -> None:
        self.metrics, self.prompt, self.num_prompt_tokens = metrics, prompt, len(request.prompt_token_ids)
        self.max_tokens = request.params.max_tokens
        self.started = time.monotonic()
        self.last_token_at: float | None = None
        self.num_tokens = 0
        self.finish_reason = "abort"
        self.queue_s: float | None = None
        self.prefill_s: float | None = None
        self.inference_s: float | None = None

    def output(self, output: RequestOutput) -> None:
        if output.new_token_ids:
            now = time.monotonic()
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.started)
                self._prompt_tokens(output.num_cached_tokens)
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            self.num_tokens += len(output.new_token_ids)
            self.metrics.generation_tokens.inc(len(output.new_token_ids))
        if output.queue_time_s is not None:
            self.queue_s, self.prefill_s = output.queue_time_s, output.inference_time_s
        if output.inference_time_s is not None:
            self.inference_s = output.inference_time_s
        if output.finished:
            self.finish_reason = output.finish_reason if output.finish_reason in FINISH_REASONS else "error"

    def _prompt_tokens(self, cached: int) -> None:
        metrics = self.metrics
        metrics.prompt_tokens.inc(self.num_prompt_tokens)
        metrics.prompt_tokens_by_source["local_compute"].inc(self.num_prompt_tokens - cached)
        metrics.prompt_tokens_by_source["local_cache_hit"].inc(cached)
        metrics.prompt_tokens_cached.inc(cached)
        metrics.prefill_kv_computed.observe(self.num_prompt_tokens - cached)

    def ended(self, finished: bool, reason: str | None = None) -> None:
        metrics = self.metrics
        metrics.success[reason or ("abort" if not finished else self.finish_reason)].inc()
        metrics.e2e.observe(time.monotonic() - self.started)
        metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.observe(self.num_tokens)
        metrics.params_max_tokens.observe(self.max_tokens)
        if self.queue_s is not None and self.prefill_s is not None and self.inference_s is not None:
            decode_s = self.inference_s - self.prefill_s
            metrics.queue_time.observe(self.queue_s)
            metrics.prefill_time.observe(self.prefill_s)
            metrics.decode_time.observe(decode_s)
            metrics.inference_time.observe(self.inference_s)
            # vLLM's per-request TPOT: the decode time over the tokens after the first (0 for one token)
            metrics.request_tpot.observe(decode_s / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0)
        self.prompt.choice_ended(self.num_tokens)


class EngineCollector(Collector):
    """The engine's latest stats, read at scrape time (the engine reports about once a second)."""

    def __init__(self, engine: EngineClient, setup: MetricsSetup) -> None:
        self.engine, self.setup = engine, setup

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats or EngineStats(running=0, waiting=0)
        labels = [self.setup.model_name, ENGINE]
        for prefix in self.setup.prefixes:
            for kind, name, doc, value in engine_figures(prefix, stats):
                family = kind(f"{prefix}:{name}", doc, labels=LABELS)
                family.add_metric(labels, value)
                yield family
            if self.engine.stats is not None:  # the page count is known once the engine reported
                yield self._cache_config(prefix, stats)
            yield step_tokens_figure(prefix, stats, labels)
            yield accepted_per_position_figure(prefix, stats, labels)
        yield from engram_figures(stats.engram or EngramStats(), labels)  # zeros without a tiered store
        if stats.offload is not None:
            yield from offload_figures(stats.offload, labels)
        yield from prefix_tier_figures(stats, labels)

    def _cache_config(self, prefix: str, stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's info-style gauge (always 1): the page size and count ride in its labels."""
        info = {"block_size": str(self.setup.block_size), "num_gpu_blocks": str(stats.pages_total), "engine": ENGINE}
        family = GaugeMetricFamily(f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=list(info))
        family.add_metric(list(info.values()), 1)
        return family


Figure = tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]


def engine_figures(prefix: str, stats: EngineStats) -> list[Figure]:
    """(kind, name, help, value) of each engine-wide figure; counters are the engine's own totals."""
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    figures: list[Figure] = [
        (gauge, "num_requests_running", "Number of requests in model execution batches.", stats.running),
        (gauge, "num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
        (gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage(stats)),
        (counter, "num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
        (counter, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries),
        (counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits),
        (counter, "spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec.drafts),
        (counter, "spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec.draft_tokens),
        (counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.spec.accepted_tokens),
    ]
    if prefix == "ds4serve":
        figures += [
            (gauge, "kv_pages_held", "KV pages held by running requests.", stats.pages_held),
            (gauge, "kv_pages_cached", "Free KV pages whose contents a cache may still reuse.", stats.pages_cached),
            (gauge, "kv_pages_total", "KV pages in the pool.", stats.pages_total),
            (counter, "spec_decode_num_draft_steps", "Draft steps the spec decoding proposer ran (one per sampling "
             "chunk it drafted after).", stats.spec.draft_steps),
            (counter, "spec_decode_num_skipped_draft_steps", "Draft steps the proposer skipped (it kept its state "
             "only): while the draft policy verified no drafts, or for a request that cannot take them "
             "(a grammar, min_tokens not reached).", stats.spec.skipped_draft_steps),
        ]
    else:  # vLLM's name before 0.9, still read by older dashboards
        figures.append((gauge, "gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", kv_usage(stats)))
    return figures


def accepted_per_position_figure(prefix: str, stats: EngineStats, labels: list[str]) -> CounterMetricFamily:
    """vLLM's accepted drafts by position (0: the first draft), one series a position drafted so far."""
    family = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", labels=[*LABELS, "position"])
    for position, count in enumerate(stats.spec.accepted_per_position):
        family.add_metric([*labels, str(position)], count)
    return family


def step_tokens_figure(prefix: str, stats: EngineStats, labels: list[str]) -> HistogramMetricFamily:
    """Tokens per engine step, from the engine's cumulative counts (vLLM's name, with its `_total`)."""
    family = HistogramMetricFamily(f"{prefix}:iteration_tokens_total",
                                   "Histogram of number of tokens per engine_step.", labels=LABELS)
    steps = stats.step_tokens
    buckets = [(floatToGoString(edge), count) for edge, count in zip(STEP_TOKEN_BUCKETS, steps.buckets)]
    family.add_metric(labels, buckets + [("+Inf", steps.count)], steps.total)
    return family


def engram_figures(stats: EngramStats, labels: list[str]) -> Iterator[Metric]:
    """The Engram row store (V4.1): rows served per tier, disk traffic, and prefetch waits."""
    rows = CounterMetricFamily("ds4serve:engram_rows_served", "Engram rows served, by the tier that served them.",
                               labels=[*LABELS, "tier"])
    for tier, value in (("resident", stats.rows_resident), ("device_cache", stats.rows_device_cache),
                        ("host_cache", stats.rows_host_cache), ("disk", stats.rows_disk)):
        rows.add_metric([*labels, tier], value)
    yield rows
    for name, doc, value in (("engram_bytes_read", "Bytes read from Engram table files.", stats.bytes_read),
                             ("engram_read_errors", "Engram page reads that failed twice or did not verify.",
                              stats.read_errors)):
        family = CounterMetricFamily(f"ds4serve:{name}", doc, labels=LABELS)
        family.add_metric(labels, value)
        yield family
    waits = HistogramMetricFamily("ds4serve:engram_prefetch_wait_seconds",
                                  "How long an Engram layer waited for its rows.", labels=LABELS)
    buckets = [(str(edge), count) for edge, count in zip(PREFETCH_WAIT_BUCKETS, stats.wait_buckets)]
    waits.add_metric(labels, buckets + [("+Inf", stats.wait_count)], stats.wait_sum_s)
    yield waits


def offload_figures(stats: ExpertOffloadStats, labels: list[str]) -> Iterator[Metric]:
    """Expert offload (offload.experts host): routed pairs by where their expert was, and the traffic
    from host RAM (issue 28: the host bytes a step next to the device's)."""
    pairs = CounterMetricFamily("ds4serve:expert_offload_pairs",
                                "Routed (token, expert) pairs, by where the expert was: resident or staged from host RAM.",
                                labels=[*LABELS, "tier"])
    pairs.add_metric([*labels, "resident"], stats.pairs_resident)
    pairs.add_metric([*labels, "staged"], stats.pairs_staged)
    yield pairs
    for name, doc, value in (
        ("expert_offload_copies", "Host-resident experts copied into staging slots.", stats.copies),
        ("expert_offload_bytes_copied", "Bytes of experts copied from host RAM.", stats.bytes_copied),
        ("expert_offload_staging_hits", "Host-resident experts a step found already staged.", stats.staging_hits),
        ("expert_offload_swaps", "Experts swapped between host RAM and residency by measured routing.", stats.swaps),
    ):
        family = CounterMetricFamily(f"ds4serve:{name}", doc, labels=LABELS)
        family.add_metric(labels, value)
        yield family


def prefix_tier_figures(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """The prefix cache by tier (gpu / host / disk, docs/prefix-tiers.md): state points held, hit tokens
    served (they add up to prefix_cache_hits), and disk fetches that failed."""
    points = GaugeMetricFamily("ds4serve:prefix_cache_points", "Prefix cache state points held, by tier.",
                               labels=[*LABELS, "tier"])
    hits = CounterMetricFamily("ds4serve:prefix_cache_hits_by_tier",
                               "Prefix cache hits, in cached tokens, by the tier that served them.",
                               labels=[*LABELS, "tier"])
    gpu_hits = stats.prefix_cache_hits - stats.prefix_host_hits - stats.prefix_disk_hits
    for tier, held, served in (("gpu", stats.prefix_gpu_points, gpu_hits),
                               ("host", stats.prefix_host_points, stats.prefix_host_hits),
                               ("disk", stats.prefix_disk_points, stats.prefix_disk_hits)):
        points.add_metric([*labels, tier], held)
        hits.add_metric([*labels, tier], served)
    failures = CounterMetricFamily("ds4serve:prefix_cache_fetch_failures",
                                   "Prefix disk tier fetches that failed their read or verification (recomputed).",
                                   labels=LABELS)
    failures.add_metric(labels, stats.prefix_fetch_failures)
    yield from (points, hits, failures)


def kv_usage(stats: EngineStats) -> float:
    """Held pages over all pages, as vLLM counts it: cached (evictable) pages count as free."""
    return stats.pages_held / stats.pages_total if stats.pages_total else 0.0
