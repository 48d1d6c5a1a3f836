"""The monitoring half of `docker compose up`, without Docker: a real Prometheus (Debian's), configured
from the shipped docker/prometheus/prometheus.yml, scrapes a running server; every expression of the
shipped Grafana dashboard is then queried there and must return data. The same server logs in JSON:
every line parses, requests carry their ids, and no key ever shows.

The server is set up so that every panel has something to show: Engram layer 1 resident and layer 4 on
disk behind a host cache too small to hold it (resident, host-cache and disk rows; prefetch waits),
repeated prompts (prefix-cache hits), a stream (inter-token latency), and more concurrent long requests
than its KV pages hold (preemptions).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from models.tiny import build_tiny_checkpoint
from tests.deploy_tools import REPO, prometheus
from tests.serving import ServerProcess, free_port, server_process

MODEL = "deploy-tiny"
KEY = "sk-deploy-secret-0123456789"
WRONG_KEY = "sk-wrong-deploy-777"
REQUEST_ID = "deploy-req-42"
AUTH = {"authorization": f"Bearer {KEY}"}
DASHBOARD = REPO / "docker/grafana/dashboards/ds4serve.json"
RATE_WINDOW = "10m"  # longer than the test: rates cover every sample since the scrapes began


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    # a checkpoint of its own: the disk tier writes its table files beside it on first use
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("deploy") / "tiny")
    args = ("--log-level", "info", "--log-format", "json", "--max-model-len", "512",
            "--set", "memory.num_kv_pages=5",  # 4 pages make one 512-token sequence; 3 at once need 9
            "--set", "engram.residency=disk", "--set", "engram.host_cache_gb=0.00002",
            "--set", "engram.layers.1.residency=host")
    with server_process(checkpoint, MODEL, *args, env={"DS4SERVE_API_KEY": KEY}) as process:
        yield process


@pytest.fixture(scope="module")
def prometheus_url(server: ServerProcess, tmp_path_factory) -> str:
    """Debian's Prometheus, on the shipped config with only the target and the intervals changed."""
    binary = prometheus()
    root = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((REPO / "docker/prometheus/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [server.base.removeprefix("http://")]
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(root / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/-/ready", timeout=1).status_code == 200, 60, "prometheus never got ready",
                 root / "prometheus.log")
        wait_for(lambda: values(url, 'up{job="ds4serve"}') == [1.0], 30, "prometheus never scraped the server",
                 root / "prometheus.log")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def wait_for(check, seconds: float, message: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{message}\n{log.read_text()[-3000:] if log else ''}")


def query(url: str, expr: str) -> list[dict]:
    response = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "success", (expr, response.text)
    return response.json()["data"]["result"]


def values(url: str, expr: str) -> list[float]:
    return [float(sample["value"][1]) for sample in query(url, expr)]


def complete(base: str, body: dict, headers: dict | None = None) -> httpx.Response:
    response = httpx.post(base + "/v1/completions", json={"model": MODEL, **body}, headers={**AUTH, **(headers or {})},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def traffic(server: ServerProcess, prometheus_url: str) -> int:
    """Requests that give every panel data; returns how many finished, once Prometheus has seen them all."""
    base = server.base
    complete(base, {"prompt": "Engram memory looks up hashed n-grams.", "max_tokens": 8}, {"x-request-id": REQUEST_ID})
    shared = "The quick brown fox jumps over the lazy dog while the server keeps serving tokens. " * 4
    for _ in range(2):  # the second one hits the prefix cache
        complete(base, {"prompt": shared, "max_tokens": 4})
    with httpx.stream("POST", base + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL, "prompt": shared, "max_tokens": 16, "stream": True,
                            "ignore_eos": True}) as stream:  # 16 chunks whatever the batch's float order picks
        assert stream.status_code == 200 and sum(1 for line in stream.iter_lines() if line.startswith("data: ")) > 8
    long_prompts = [[7 + (31 * i + 17 * j) % 500 for j in range(250)] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:  # 3 x 3 pages wanted, 5 in the pool: the scheduler must preempt
        list(pool.map(lambda ids: complete(base, {"prompt": ids, "max_tokens": 60, "min_tokens": 60}), long_prompts))
    assert httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
    finished = 7
    wait_for(lambda: values(prometheus_url, f'sum(vllm:request_success_total{{model_name="{MODEL}"}})') == [finished],
             60, "prometheus never saw every request finish")
    time.sleep(2.5)  # a few more scrapes, so every rate has its last samples
    return finished


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def as_grafana_would(expr: str) -> str:
    """The dashboard's variables filled in: this server's model, and a window covering the whole test."""
    return expr.replace("$model_name", MODEL).replace("$__rate_interval", RATE_WINDOW)


@pytest.mark.parametrize("title, expr", dashboard_exprs(), ids=[f"{t} {e[:40]}" for t, e in dashboard_exprs()])
def test_every_dashboard_expression_returns_data(traffic, prometheus_url, title, expr):
    result = query(prometheus_url, as_grafana_would(expr))
    assert result, f"{title}: {expr} returned no series"
    numbers = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(n) for n in numbers), f"{title}: {expr} returned only {numbers}"


def test_the_dashboard_variable_lists_the_served_model(traffic, prometheus_url):
    variable = json.loads(DASHBOARD.read_text())["templating"]["list"][0]
    metric, label = variable["query"]["query"].removeprefix("label_values(").removesuffix(")").split(", ")
    assert MODEL in {sample["metric"][label] for sample in query(prometheus_url, metric)}


def test_the_figures_behind_the_panels_moved(traffic, prometheus_url):
    """Not just present: each thing the setup meant to provoke happened."""
    def total(expr: str) -> float:
        return sum(values(prometheus_url, expr.replace("{}", f'{{model_name="{MODEL}"}}')))

    assert total("vllm:prefix_cache_hits_total{}") > 0
    assert total("vllm:num_preemptions_total{}") > 0
    assert total("vllm:inter_token_latency_seconds_count{}") > 8
    rows = query(prometheus_url, "ds4serve:engram_rows_served_total")
    tiers = {sample["metric"]["tier"]: float(sample["value"][1]) for sample in rows}
    assert tiers["resident"] > 0 and tiers["disk"] > 0 and tiers["host_cache"] > 0, tiers
    assert total("ds4serve:engram_prefetch_wait_seconds_count{}") > 0


def test_logs_are_json_with_request_ids_and_no_keys(traffic, server):
    lines = [line for line in server.output.splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line: a JSON object, the engine process's too
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in entries)
    assert {"MainProcess", "ds4serve-engine"} <= {entry["process"] for entry in entries}
    ours = [e for e in entries if e.get("request_id") == REQUEST_ID]
    assert any(e["logger"] == "uvicorn.access" and "POST /v1/completions" in e["msg"] for e in ours), ours
    assert any(e["logger"] == "uvicorn.access" and '401' in e["msg"] and e.get("request_id") for e in entries)
    assert KEY not in server.output and WRONG_KEY not in server.output
