"""What `docker compose up` and the rig YAMLs rest on, checked without a Docker engine.

Every compose file through a real Compose v2 binary (`config`: the schema, interpolation, merging of
the GPU override) and then what the normalized project must hold; the Dockerfiles through hadolint and
against the build context; every rig YAML through the project's own loader; the Prometheus config
through promtool; the dashboard's wiring to the provisioned datasource. No image is built here.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import yaml

from contract.config import ConfigFileError, load_config
from models.config import ModelConfig
from tests.deploy_tools import REPO, compose_binary, hadolint, promtool, run

COMPOSE_OVERRIDES = sorted((REPO / "docker").glob("compose*.yaml"))
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
RIGS = sorted((REPO / "configs").glob("*.yaml"))
GPU_RIGS = [rig for rig in RIGS if rig.name != "cpu-tiny.yaml"]


def compose_config(*files, env: dict[str, str] | None = None):
    """`docker compose -f ... config`: the project as Compose v2 resolves it (JSON), or its refusal."""
    args = [compose_binary()]
    for file in files:
        args += ["-f", file]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DS4SERVE_", "COMPOSE_", "GRAFANA_"))}
    return run(*args, "config", "--format", "json", env={**clean, **(env or {})})


def project(*files) -> dict:
    result = compose_config(*files)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_shipped_files_are_all_there():
    assert (REPO / "compose.yaml").exists() and COMPOSE_OVERRIDES == [REPO / "docker" / "compose.gpu.yaml"]
    assert [d.name for d in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]
    assert {r.name for r in RIGS} == {"cpu-tiny.yaml", "rtxpro6000x4.yaml", "h200x1.yaml", "h200x1-offload.yaml",
                                      "v100x4-offload.yaml"}


def test_compose_up_starts_the_server_prometheus_and_grafana():
    services = project(REPO / "compose.yaml")["services"]
    assert set(services) == {"ds4serve", "prometheus", "grafana"}
    server = services["ds4serve"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    command = " ".join(server["command"])
    assert "--config configs/cpu-tiny.yaml" in command and "--host 0.0.0.0" in command
    assert "--set server.api_key_file=/run/secrets/ds4serve_api_key" in command and "--log-format json" in command
    assert any("/health" in part for part in server["healthcheck"]["test"])
    assert server["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert server["ipc"] == "host" or int(server.get("shm_size", 0)) >= 2**30
    assert {v["target"] for v in server["volumes"]} == {"/models", "/engram"}
    assert [s["source"] for s in server["secrets"]] == ["ds4serve_api_key"]
    assert server["environment"] == {"DS4SERVE_API_KEY": ""}  # set: passed through; unset: the secret file decides
    assert [(p["target"], p["host_ip"]) for p in server["ports"]] == [(8000, "127.0.0.1")]


def test_prometheus_and_grafana_mount_the_shipped_files():
    compose = project(REPO / "compose.yaml")
    services = compose["services"]
    mounts = {s: {v["target"]: v["source"] for v in services[s]["volumes"]} for s in ("prometheus", "grafana")}
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == str(REPO / "docker/prometheus/prometheus.yml")
    assert mounts["grafana"]["/etc/grafana/provisioning"] == str(REPO / "docker/grafana/provisioning")
    providers = yaml.safe_load((REPO / "docker/grafana/provisioning/dashboards/ds4serve.yml").read_text())
    provider = providers["providers"][0]
    assert mounts["grafana"][provider["options"]["path"]] == str(REPO / "docker/grafana/dashboards")
    assert compose["secrets"]["ds4serve_api_key"]["file"] == str(REPO / "docker/secrets/no-api-key")
    assert (REPO / "docker/secrets/no-api-key").read_text() == ""  # no key unless the user names a file
    scrape = yaml.safe_load((REPO / "docker/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["ds4serve:8000"] and scrape["metrics_path"] == "/metrics"


def test_the_gpu_override_reserves_gpus_and_names_a_rig():
    server = project(REPO / "compose.yaml", REPO / "docker/compose.gpu.yaml")["services"]["ds4serve"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": -1}]
    assert server["ipc"] == "host" and server["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert "seccomp=unconfined" in server["security_opt"]  # io_uring for the Engram disk tier
    assert server["healthcheck"]["start_period"] == "30m0s" and server["healthcheck"]["test"][0] == "CMD"
    rig = server["command"][server["command"].index("--config") + 1]
    assert (REPO / rig).exists() and load_config(REPO / rig).runtime.device == "cuda"
    chosen = compose_config(REPO / "compose.yaml", REPO / "docker/compose.gpu.yaml",
                            env={"DS4SERVE_CONFIG": "configs/h200x1.yaml", "DS4SERVE_CHECKPOINTS": "/srv/models"})
    server = json.loads(chosen.stdout)["services"]["ds4serve"]
    assert "configs/h200x1.yaml" in server["command"] and "/srv/models" in [v["source"] for v in server["volumes"]]


def test_the_compose_binary_refuses_a_broken_file(tmp_path):
    """The check is only worth something if a mistake fails it: a misspelt key, a bad ulimit."""
    for broken in ("ulimts:\n      memlock: -1\n", "ulimits:\n      memlock: lots\n"):
        shipped = (REPO / "compose.yaml").read_text()
        text = shipped.replace("ulimits:\n      memlock:\n        soft: -1\n        hard: -1\n", broken)
        assert text != shipped
        (tmp_path / "compose.yaml").write_text(text)
        result = compose_config(tmp_path / "compose.yaml")
        assert result.returncode != 0, broken


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    result = run(hadolint(), dockerfile)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM python\nRUN pip install torch\nUSER root\n")
    assert run(hadolint(), tmp_path / "Dockerfile").returncode != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_only_what_the_build_context_sends(dockerfile):
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copies = re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", dockerfile.read_text(), re.MULTILINE)
    assert copies
    for sources in copies:
        for source in sources.split():
            assert (REPO / source).exists(), source
            assert source.split("/")[0] not in ignored, f"{source} is excluded by .dockerignore"
    assert "COPY default_model ./default_model" in DOCKERFILES[0].read_text()  # the CPU image carries the default


@pytest.mark.parametrize("rig", RIGS, ids=lambda p: p.name)
def test_every_rig_yaml_loads_and_names_its_model(rig):
    config = load_config(rig)
    assert config.model.served_name, "each rig names the model it serves"
    text = rig.read_text()
    assert text.startswith("#") and text.count("#") > 5, "rig files are commented"
    if rig.name == "cpu-tiny.yaml":
        assert config.model.path is None and config.runtime.device == "cpu"
        return
    name = config.model_dir.name
    assert config.model.path == f"/models/{name}" and config.runtime.device == "cuda"
    assert config.memory.gpu_memory_gb, "plan needs the GPU's memory"
    model = ModelConfig.from_file(REPO / "configs/models" / name / "config.json")
    assert model.is_v41 == ("V4.1" in name)


def test_the_published_model_configs_parse_as_the_releases_describe_them():
    v4 = ModelConfig.from_file(REPO / "configs/models/DeepSeek-V4-Flash/config.json")
    assert (v4.num_layers, v4.hidden_size, v4.n_routed_experts, v4.moe_intermediate_size) == (43, 4096, 256, 2048)
    assert v4.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",) and v4.compress_rates[:4] == (0, 0, 4, 128)
    v41 = ModelConfig.from_file(REPO / "configs/models/DeepSeek-V4.1-Flash/config.json")
    assert (v41.num_layers, v41.hidden_size, v41.n_routed_experts, v41.moe_intermediate_size) == (40, 5120, 384, 2304)
    assert v41.shared_compression.kv_sources == (2, 8, 14, 20) and v41.engram.layer_ids == (1, 14)
    assert v41.engram.num_embeddings == (384006168, 384016682) and v41.rms_norm_eps == 1e-20


def test_a_bad_rig_key_names_the_key_and_the_file(tmp_path):
    rig = tmp_path / "rig.yaml"
    rig.write_text((REPO / "configs/v100x4-offload.yaml").read_text().replace("experts: disk", "experts: sometimes"))
    with pytest.raises(ConfigFileError, match=rf"{rig}: offload.experts: Input should be"):
        load_config(rig)
    rig.write_text((REPO / "configs/h200x1.yaml").read_text().replace("gpu_memory_gb:", "gpu_mem_gb:"))
    with pytest.raises(ConfigFileError, match=rf"{rig}: memory.gpu_mem_gb: unknown key"):
        load_config(rig)


@pytest.mark.parametrize("rig, named", [("v100x4-offload.yaml", "offload.experts")])
def test_serving_refuses_what_this_version_has_not_built(rig, named):
    result = run(sys.executable, "-m", "server", "--config", f"configs/{rig}")
    assert result.returncode == 2 and "not built in this version" in result.stderr and named in result.stderr


def test_promtool_accepts_the_shipped_prometheus_config():
    result = run(promtool(), "check", "config", REPO / "docker/prometheus/prometheus.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr


def test_promtool_refuses_a_broken_config(tmp_path):
    broken = tmp_path / "prometheus.yml"
    shipped = (REPO / "docker/prometheus/prometheus.yml").read_text()
    broken.write_text(shipped.replace("scrape_interval: 5s", "scrape_interval: often"))
    assert run(promtool(), "check", "config", broken).returncode != 0


def test_every_dashboard_panel_reads_the_provisioned_datasource():
    datasource = yaml.safe_load((REPO / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    source = datasource["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    dashboard = json.loads((REPO / "docker/grafana/dashboards/ds4serve.json").read_text())
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for topic in ("Requests", "Time to first token", "Inter-token", "Tokens / s", "KV cache usage", "Prefix cache",
                  "Engram rows", "Engram prefetch wait", "Preemptions"):
        assert topic in titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"] and panel["targets"]
        assert all(t["datasource"]["uid"] == source["uid"] and t["expr"] for t in panel["targets"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert "vllm:prefix_cache_hits_total" in exprs and "vllm:prefix_cache_queries_total" in exprs
