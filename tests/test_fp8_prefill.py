"""`model.prefill_activations: fp8` on CPU: the key is refused where it could not do what it says (weights
not held as released, deterministic mode, no FP8 tensor cores, a float32 model), each refusal naming it,
and on a released model it switches every module that can take e4m3 activations. The kernels it selects
are checked in tests/test_moe_mxfp4_fp8.py (interpreter) and tests/test_gpu.py (compiled, and a released
model's prefill with it against one without)."""

from __future__ import annotations

import pytest
import torch

from contract.config import DEFAULT_MODEL_DIR, ConfigFileError, load_config
from engine.factory import check_fp8_prefill
from engine.layout import EngineConfigError
from models.dummy_weights import build_dummy_model
from models.layers import Fp8Linear, TakesFp8Prefill, prefill_in_fp8
from models.moe import Experts


def config_file(tmp_path, text: str):
    path = tmp_path / "rig.yaml"
    path.write_text(text)
    return path


def test_fp8_prefill_needs_the_weights_held_as_released(tmp_path):
    path = config_file(tmp_path, "model:\n  prefill_activations: fp8\n")
    with pytest.raises(ConfigFileError, match="prefill_activations: fp8 needs quantization: checkpoint") as error:
        load_config(path)
    assert str(path) in str(error.value)
    held = load_config(config_file(tmp_path, "model:\n  prefill_activations: fp8\n  quantization: checkpoint\n"))
    assert held.model.prefill_activations == "fp8"
    assert load_config(config_file(tmp_path, "model: {}\n")).model.prefill_activations == "model"
    with pytest.raises(ConfigFileError, match="prefill_activations"):
        load_config(config_file(tmp_path, "model:\n  prefill_activations: fp4\n"))


def test_fp8_prefill_and_deterministic_mode_are_refused_together(tmp_path):
    path = config_file(tmp_path, "model:\n  prefill_activations: fp8\n  quantization: checkpoint\n"
                                 "runtime:\n  deterministic: true\n")
    with pytest.raises(ConfigFileError, match="prefill_activations: fp8 and runtime.deterministic"):
        load_config(path)


def test_fp8_prefill_needs_fp8_tensor_cores_and_a_bf16_model(tmp_path):
    config = load_config(config_file(tmp_path, "model:\n  prefill_activations: fp8\n  quantization: checkpoint\n"))
    with pytest.raises(EngineConfigError, match="model.prefill_activations fp8 needs an NVIDIA GPU"):
        check_fp8_prefill(config, "cpu", torch.bfloat16)
    check_fp8_prefill(load_config(config_file(tmp_path, "model: {}\n")), "cpu", torch.float32)  # off: no check
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        with pytest.raises(EngineConfigError, match="model.dtype is torch.float32"):
            check_fp8_prefill(config, "cuda", torch.float32)


def test_prefill_in_fp8_switches_every_released_module_that_can_take_it():
    model = build_dummy_model(DEFAULT_MODEL_DIR, 0, released=True, tokenizer_dir=DEFAULT_MODEL_DIR, engram=None)
    able = [module for module in model.modules() if isinstance(module, (Experts, Fp8Linear))]
    assert able and all(isinstance(module, TakesFp8Prefill) and not module.fp8_prefill for module in able)
    assert prefill_in_fp8(model) == len(able)
    assert all(module.fp8_prefill for module in able)
    assert any(isinstance(module, Experts) for module in able) and any(isinstance(module, Fp8Linear) for module in able)
