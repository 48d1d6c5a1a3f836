"""Checkpoint loading: clear errors for bad tensors, sharded files, FP8 and MXFP4 weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import quantize_fp8_blocks, quantize_mxfp4
from models import CheckpointError, load_model


@pytest.fixture
def copy(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoints["mixed"], target)
    return target


def rewrite(directory, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def quantize_as_released(tensors: dict, dense_name: str) -> None:
    """`dense_name` as FP8 (128x128 block scales, HF `_scale_inv`), layer 2's experts as per-expert
    MXFP4 weights with the release's `.scale` exponents."""
    values, scale = quantize_fp8_blocks(tensors[dense_name])
    tensors[dense_name], tensors[dense_name + "_scale_inv"] = values, scale
    fused = tensors.pop("model.layers.2.mlp.experts.gate_up_proj")
    down = tensors.pop("model.layers.2.mlp.experts.down_proj")
    for expert in range(fused.shape[0]):
        w1, w3 = fused[expert].chunk(2)
        for part, matrix in (("w1", w1), ("w3", w3), ("w2", down[expert])):
            packed, exponents = quantize_mxfp4(matrix)
            tensors[f"model.layers.2.ffn.experts.{expert}.{part}.weight"] = packed
            tensors[f"model.layers.2.ffn.experts.{expert}.{part}.scale"] = exponents


def test_missing_tensor_is_named(copy):
    rewrite(copy, lambda t: t.pop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.compressor\.indexer\.q_b_proj\.weight'"):
        load_model(copy)


def test_misshaped_tensor_is_named(copy):
    def edit(t):
        t["model.layers.2.self_attn.kv_proj.weight"] = torch.zeros(31, 64)

    rewrite(copy, edit)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.kv_proj\.weight'.*\(31, 64\).*\(32, 64\)"):
        load_model(copy)


def test_unexpected_tensor_is_named(copy):
    rewrite(copy, lambda t: t.__setitem__("model.layers.0.self_attn.surprise", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="surprise"):
        load_model(copy)


def test_sharded_checkpoint_with_index(copy, checkpoints):
    tensors = load_file(str(copy / "model.safetensors"))
    (copy / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in enumerate((names[:half], names[half:])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(copy / file))
        weight_map.update({n: file for n in part})
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, original = load_model(copy), load_model(checkpoints["mixed"])
    for (name, a), (_, b) in zip(loaded.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name


def test_fp8_and_mxfp4_weights_dequantize_in_place(copy, checkpoints):
    """FP8 (128x128 block scales, HF `_scale_inv`) and MXFP4 (E8M0 per 32, release `.scale` on per-expert
    weights) load close to the full-precision weights; a transposed or misaligned scale would not."""
    dense_name = "model.layers.1.self_attn.q_b_proj.weight"
    original = load_file(str(copy / "model.safetensors"))

    rewrite(copy, lambda t: quantize_as_released(t, dense_name))
    model = load_model(copy)
    params = dict(model.named_parameters())
    fp8_error = (params[dense_name] - original[dense_name]).abs().max() / original[dense_name].abs().max()
    assert 0 < fp8_error < 0.07
    for name in ("gate_up_proj", "down_proj"):
        loaded, dense = params[f"model.layers.2.mlp.experts.{name}"], original[f"model.layers.2.mlp.experts.{name}"]
        blocks = (loaded - dense).view(*dense.shape[:-1], -1, 32).abs().amax(-1)
        block_amax = dense.view(*dense.shape[:-1], -1, 32).abs().amax(-1)
        assert (blocks <= block_amax * 0.25 + 1e-6).all(), name
        assert torch.corrcoef(torch.stack([loaded.flatten(), dense.flatten()]))[0, 1] > 0.95


def test_quantized_weights_kept_as_stored_give_the_dequantized_models_logits(copy, checkpoints):
    """`keep_quantized` (model.quantization: checkpoint): the FP8 linear becomes an Fp8Linear and the
    MXFP4 experts stay packed (4.25 bits a weight); the logits are bitwise those of the model that
    dequantized them at load (the CPU reference dequantizes the same values per use)."""
    from kernels.moe import MXFP4Experts
    from models import ForwardBatch
    from models.layers import Fp8Linear
    from tests.conftest import random_tokens

    dense = "model.layers.1.self_attn.q_b_proj"
    rewrite(copy, lambda t: quantize_as_released(t, dense + ".weight"))
    kept, dequantized = load_model(copy, keep_quantized=True), load_model(copy)
    assert isinstance(kept.get_submodule(dense), Fp8Linear) and kept.get_submodule(dense).weight.dtype == torch.float8_e4m3fn
    experts = kept.get_submodule("model.layers.2.mlp.experts")
    assert isinstance(experts.weights("gate_up_proj"), MXFP4Experts) and "gate_up_proj" not in dict(experts.named_parameters())
    plain = dequantized.get_submodule("model.layers.2.mlp.experts").gate_up_proj
    assert torch.equal(torch.stack([experts.weights("gate_up_proj").expert(e, torch.float32) for e in range(plain.shape[0])]), plain)
    kept_bytes = sum(t.numel() * t.element_size() for t in list(kept.parameters()) + list(kept.buffers()))
    plain_bytes = sum(t.numel() * t.element_size() for t in list(dequantized.parameters()) + list(dequantized.buffers()))
    assert kept_bytes < plain_bytes
    batch = ForwardBatch.build([(0, random_tokens(40, seed=5), 0)], logits="all")
    assert torch.equal(kept(batch, kept_cache(kept)), dequantized(batch, kept_cache(dequantized)))


def kept_cache(model):
    from models import ModelCache

    return ModelCache.allocate(model.config, 1, 64)


def test_fp8_blocks_follow_the_configs_weight_block_size(copy, checkpoints):
    """V4.1-Flash stores FP8 in 32 x 32 blocks (quantization_config.weight_block_size): the loader maps
    each scale to its block, dequantized or kept (Fp8Linear); read as 128 x 128 they would be wrong."""
    from models.layers import Fp8Linear

    name = "model.layers.1.self_attn.q_b_proj.weight"
    original = load_file(str(copy / "model.safetensors"))[name]
    assert original.shape[0] > 32  # several blocks of rows

    def edit(t):
        t[name], t[name + "_scale_inv"] = quantize_fp8_blocks(t[name], block=32)

    rewrite(copy, edit)

    def error(model) -> float:
        loaded = dict(model.named_parameters())[name]
        return float((loaded - original).abs().max() / original.abs().max())

    misread = error(load_model(copy))  # without the config's block size: the 128 x 128 default
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (copy / "config.json").write_text(json.dumps(config))
    dequantized = load_model(copy)
    assert 0 < error(dequantized) < 0.07 and misread > 2 * error(dequantized)
    kept = load_model(copy, keep_quantized=True)
    linear = kept.get_submodule(name.removesuffix(".weight"))
    assert isinstance(linear, Fp8Linear) and linear.block == 32
    x = torch.randn(3, linear.in_features)
    assert torch.equal(linear(x), dequantized.get_submodule(name.removesuffix(".weight"))(x))
    config["quantization_config"]["weight_block_size"] = [32, 64]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_model(copy)
