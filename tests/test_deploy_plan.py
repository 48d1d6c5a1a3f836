"""`python -m server plan`: weights equal to the meta model's bytes, the rigs that fit and the ones
refused (with what is missing), and the tiny rig's plan equal to what the engine itself allocates."""

from __future__ import annotations

import sys

import pytest
import torch

from contract.config import load_config
from engine.factory import build_engine_core
from engine.memory_plan import model_bytes
from engine.plan import PlanRefused, build_plan, model_config_json
from engine.plan_weights import weight_tensors
from models import load_model
from models.config import ModelConfig
from models.loader import FLOAT32_MARKERS
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from server.__main__ import main as server_main
from tests.deploy_tools import REPO, run
from worker.runner import ModelRunner

GiB = 2**30
RIGS = ("cpu-tiny", "rtxpro6000x4", "h200x1", "h200x1-offload", "v100x4-offload")
# The published DeepSeek-V4.1-Flash safetensors, their headers summed by group (GiB, as a public
# deployment study of the release reports them): what the plan's "as stored" figures must reproduce.
V41_PUBLISHED_GIB = {"routed experts": 268.95, "attention": 4.72, "shared expert": 1.32, "embedding / head": 2.46}
V41_ENGRAM_TABLES_GIB = 188.83  # both tables, fp8 values + ue8m0 scales
FP8_NAMES = ("q_a_proj.weight", "q_b_proj.weight", ".kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
             "wkv.weight")


def plan_cli(*args: str):
    """`python -m server plan ARGS` in a process of its own, as a user runs it."""
    return run(sys.executable, "-m", "server", "plan", *args, timeout=300)


def plan_main(capsys, *args: str) -> tuple[int, str, str]:
    """The same command line through server/__main__.py in this process (torch is imported once)."""
    status = server_main(["plan", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def rig(name: str, *overrides: str):
    path = REPO / "configs" / f"{name}.yaml"
    config = load_config(path, list(overrides))
    return config, path, model_config_json(config)


def independent_bytes(config_json, quantization: str, dtype: torch.dtype) -> int:
    """The meta model's bytes, counted here from its parameters alone (not through engine/plan_weights.py):
    as loaded, or as the release stores it (E2M1 pairs + a scale per 32 for experts, FP8 + a scale per
    block for the attention projections, shared expert and Engram wkv)."""
    model_config = ModelConfig.from_file(config_json)
    with torch.device("meta"):
        model = DeepseekV41(model_config) if model_config.is_v41 else DeepseekV4(model_config)
    total = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        n = tensor.numel()
        held = torch.float32 if any(m in name for m in FLOAT32_MARKERS) else dtype
        plain = n * (held.itemsize if tensor.dtype.is_floating_point else tensor.dtype.itemsize)
        if quantization == "none":
            total += plain
        elif ".mlp.experts." in name:
            total += n // 2 + n // 32
        elif ".shared_experts." in name or name.endswith(FP8_NAMES) and not any(
                part in name for part in (".compressor.", ".indexer.")):
            rows, cols = tensor.shape
            block = 32 if model_config.is_v41 else 128  # the releases' weight_block_size
            total += n + -(-rows // block) * -(-cols // block)
        else:
            total += plain
    return total


@pytest.mark.parametrize("name", RIGS)
def test_the_weight_figure_is_the_byte_count_of_the_meta_model(name):
    config, _, config_json = rig(name)
    dtype = torch.float32 if config.runtime.device == "cpu" else getattr(torch, config.model.dtype)
    _, tensors = weight_tensors(config_json, config.model.quantization, dtype)
    assert sum(t.nbytes for t in tensors) == independent_bytes(config_json, config.model.quantization, dtype)


def test_v41_flash_as_stored_reproduces_the_published_checkpoint():
    config, path, config_json = rig("rtxpro6000x4")
    plan = build_plan(config, path, config_json)
    for kind, published in V41_PUBLISHED_GIB.items():
        assert sum(t.nbytes for t in plan.weights if t.kind == kind) / GiB == pytest.approx(published, abs=0.01), kind
    assert plan.engram.disk_bytes / GiB == pytest.approx(V41_ENGRAM_TABLES_GIB, abs=0.01)


def test_the_tiny_rig_plans_what_the_engine_allocates(checkpoints):
    overrides = (f"model.path={checkpoints['v41']}",)
    config, path, config_json = rig("cpu-tiny", *overrides)
    plan = build_plan(config, path, config_json)
    model = load_model(checkpoints["v41"], engram=None)
    assert plan.weights_bytes == model_bytes(model) - model.engram_memory.source.resident_bytes()
    sched = config.scheduler
    runner = ModelRunner(model, sched.max_num_seqs, plan.max_model_len, num_pages=1, block_tokens=sched.block_tokens,
                         snapshot_slots=sched.snapshot_slots)
    assert (plan.kv.page_bytes, plan.kv.slot_state_bytes) == (runner.cache.page_bytes(), runner.cache.slot_bytes())
    _, spec = build_engine_core(config, lambda output: None)
    assert plan.kv.num_pages == spec.memory.num_pages == 8 * 32


def test_rtxpro6000x4_fits():
    result = plan_cli("--config", "configs/rtxpro6000x4.yaml")
    assert result.returncode == 0, result.stderr
    config, path, config_json = rig("rtxpro6000x4")
    plan = build_plan(config, path, config_json)
    assert f"{plan.weights_bytes:,} bytes on the meta device" in result.stdout and "fits        yes" in result.stdout
    per_sequence = config.model.max_model_len // config.scheduler.block_tokens
    assert plan.kv.num_pages == config.scheduler.max_num_seqs * per_sequence  # every sequence at full length
    assert plan.ranks == 4 and plan.weights_per_rank < plan.weights_bytes / 3
    assert "tensor-parallel pool" not in result.stdout and "needs       nothing unbuilt" in result.stdout


def test_v4_flash_does_not_fit_one_h200(capsys):
    status, out, err = plan_main(capsys, "--config", "configs/h200x1.yaml")
    assert status == 1 and out == ""
    assert "DeepSeek-V4-Flash does not fit" in err and "memory.gpu_memory_gb 139.8" in err
    assert "parallel.tensor_parallel_size" in err and "offload.experts" in err


def test_v41_flash_on_four_v100s_is_refused_for_want_of_expert_offload(capsys):
    status, _, err = plan_main(capsys, "--config", "configs/v100x4-offload.yaml")
    assert status == 1
    assert "offload.experts: 'disk': expert offload to NVMe is not built yet" in err
    assert "without it DeepSeek-V4.1-Flash does not fit" in err
    config, path, config_json = rig("v100x4-offload", "offload.experts=none", "offload.kv=none")
    with pytest.raises(PlanRefused, match="Routed experts are 67.24 GiB"):
        build_plan(config, path, config_json)


def test_v4_flash_fits_one_h200_with_expert_offload(capsys):
    """offload.experts host, no count given: every MoE layer keeps as many experts on the GPU as fit with
    every sequence's full-length KV, the rest in pinned host RAM; every byte of the experts placed once."""
    status, out, err = plan_main(capsys, "--config", "configs/h200x1-offload.yaml")
    assert status == 0, err
    config, path, config_json = rig("h200x1-offload")
    plan = build_plan(config, path, config_json)
    e = plan.experts
    routed = sum(t.nbytes for t in plan.weights if t.kind == "routed experts")
    assert (e.layers, e.experts_per_layer) == (43, 256) and e.expert_bytes * 43 * 256 == routed
    assert 0 < e.gpu_per_layer < 256 and e.gpu_bytes + e.host_bytes == routed
    assert plan.kv.weights_bytes == plan.gpu_weights_per_rank == plan.weights_bytes - e.host_bytes + e.staging_bytes
    assert e.host_bytes <= config.memory.host_memory_gb * GiB
    per_sequence = -(-plan.max_model_len // config.scheduler.block_tokens)
    assert plan.kv.num_pages == config.scheduler.max_num_seqs * per_sequence  # every sequence at full length
    one_more = plan.kv.weights_bytes + plan.kv.workspace_bytes + plan.kv.slot_state_bytes + plan.kv.kv_bytes
    assert one_more + 43 * e.expert_bytes > plan.kv.budget_bytes  # the GPU could not keep one more a layer
    assert f"{e.gpu_per_layer} of 256 a layer resident" in out and "fits        yes" in out
    assert "offload.experts: 'host'" in out and "issue 28" in out


def test_the_server_refuses_expert_offload_it_cannot_serve_yet(capsys):
    assert server_main(["--config", "configs/h200x1-offload.yaml"]) == 2
    assert "cannot start: not built in this version: offload.experts: 'host'" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, per_layer", [
    (("offload.gpu_experts_per_layer=100",), 100),
    (("offload.gpu_experts_gb=100",), int(100 * GiB) // (43 * 13_369_344)),  # 12.75 MiB an expert as released
])
def test_expert_offload_keeps_the_count_the_config_asks_for(overrides, per_layer):
    config, path, config_json = rig("h200x1-offload", *overrides)
    e = build_plan(config, path, config_json).experts
    assert e.expert_bytes == 13_369_344 and e.gpu_per_layer == per_layer and e.host_per_layer == 256 - per_layer


@pytest.mark.parametrize("overrides, says, status", [
    (("offload.gpu_experts_per_layer=240",), "DeepSeek-V4-Flash does not fit", 1),  # too many kept on the GPU
    (("offload.gpu_experts_per_layer=20",), "pinned host RAM", 1),  # the rest is more than the host's RAM
    (("offload.gpu_experts_per_layer=300",), "offload.gpu_experts_per_layer 300", 2),
    (("offload.staging_experts=4", "offload.gpu_experts_per_layer=200"), "offload.staging_experts 4", 2),
    (("offload.gpu_experts_per_layer=100", "offload.gpu_experts_gb=10"), "not both", 2),
    (("offload.experts=none", "offload.gpu_experts_gb=10"), "offload.gpu_experts_gb", 2),
])
def test_expert_offload_refuses_what_cannot_be_placed(capsys, overrides, says, status):
    sets = [arg for override in overrides for arg in ("--set", override)]
    got, _, err = plan_main(capsys, "--config", "configs/h200x1-offload.yaml", *sets)
    assert (got, says in err) == (status, True), err


@pytest.mark.parametrize("overrides, says", [
    (("parallel.tensor_parallel_size=1",), "DeepSeek-V4.1-Flash does not fit"),  # all of it on one GPU
    (("memory.gpu_memory_gb=24",), "over the budget"),  # four small GPUs
    (("model.max_model_len=1048576", "scheduler.max_num_seqs=1", "memory.gpu_memory_utilization=0.82"),
     "one sequence of model.max_model_len=1048576 tokens needs"),  # weights fit, one full-length sequence not
    (("engram.host_cache_gb=300",), "the Engram tiers need"),  # more host RAM than the rig has
])
def test_an_impossible_override_is_refused(capsys, overrides, says):
    sets = [arg for override in overrides for arg in ("--set", override)]
    status, _, err = plan_main(capsys, "--config", "configs/rtxpro6000x4.yaml", *sets)
    assert status == 1 and says in err, err


def test_a_bad_override_is_a_config_error_naming_the_key(capsys):
    status, _, err = plan_main(capsys, "--config", "configs/rtxpro6000x4.yaml", "--set", "memory.gpu_memory_gb=-1")
    assert status == 2 and "memory.gpu_memory_gb" in err


def test_make_plan_runs_the_plan_command():
    dry = run("make", "-n", "plan", "CONFIG=configs/h200x1.yaml")
    assert dry.returncode == 0 and "-m server plan --config configs/h200x1.yaml" in dry.stdout
