"""Seeded random weights: the per-parameter rule, and whole models built in place on a device.

The rule (`random_tensor`) keeps activations O(1) through every layer, so no branch is dead; the tiny
checkpoint (models/tiny.py) writes its weights with it. `build_random_model` draws every parameter
straight into device memory in its serving dtype, with no checkpoint: a 4-layer V4-Flash-dims slice is
27.4B parameters (55 GB in bf16), which the benchmark machine's disk could not hold twice.
"""

from __future__ import annotations

import math

import torch

from kernels.quant import quantize_fp8_blocks, quantize_mxfp4
from models.config import ConfigError, ModelConfig
from models.layers import Fp8Linear
from models.loader import _assign, _target_dtype, fp8_candidates
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.moe import Experts


def random_tensor(
    name: str, shape: torch.Size, n_experts: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A parameter named `name` drawn on `generator`'s device, in `dtype` (in place, so a large bf16
    tensor needs no float32 temporary). Hash routing tables (`tid2eid`) get distinct experts per row."""
    device, leaf = generator.device, name.rsplit(".", 1)[-1]

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(std).add_(mean)

    if leaf == "tid2eid":
        keys = torch.rand((shape[0], n_experts), generator=generator, device=device)
        return keys.argsort(dim=-1)[:, : shape[1]]
    if "norm" in name:
        return normal(0.1, mean=1.0)
    if leaf in ("scale", "hc_scale"):
        return torch.rand(shape, generator=generator, dtype=dtype, device=device).add_(0.5)
    if leaf in ("q_weight", "k_weight"):
        return normal(0.3, mean=1.0)
    if leaf in ("base", "hc_base", "e_score_correction_bias", "e_score_correction_bias_vl"):
        return normal(0.1)
    if leaf in ("sinks", "position_bias"):
        return normal(0.5)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    return normal(1.0 / math.sqrt(shape[-1]))  # projections: fan-in is the last dim


def build_random_model(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0
) -> DeepseekV4 | DeepseekV41:
    """The model with seeded random weights, each drawn on `device` in the dtype the loader would give
    it (norms, mHC, sinks and biases float32; the rest `dtype`). Engram tables are not built here."""
    if config.engram is not None:
        raise ConfigError("build_random_model does not build Engram tables: use a config without engram_layer_ids")
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV41(config) if config.is_v41 else DeepseekV4(config)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = _target_dtype(name, dtype, tensor.dtype)
        _assign(model, name, random_tensor(name, tensor.shape, config.n_routed_experts, generator, target))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


RELEASED_FP8 = tuple(f"self_attn.{p}_proj" for p in ("q_a", "q_b", "kv", "o_b"))


@torch.no_grad()
def quantize_as_released(model: DeepseekV4 | DeepseekV41) -> None:
    """Puts a model's weights in the release's formats, in place on their device: routed experts MXFP4
    (kept packed); the attention projections and the shared expert FP8 with 128 x 128 block scales
    (Fp8Linear; the release also stores o_a_proj so, which serving dequantizes); what
    `model.quantization: checkpoint` serves from a real checkpoint. One expert at a time, so the
    temporaries stay small next to a 55 GB bf16 slice."""
    for module in list(model.modules()):
        if isinstance(module, Experts):
            for leaf in ("gate_up_proj", "down_proj"):
                dense = module.weights(leaf)
                packed = [quantize_mxfp4(dense[e]) for e in range(dense.shape[0])]
                module.keep_packed(leaf, torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]))
                del dense, packed
    for name, linear in fp8_candidates(model):
        if not (name.endswith(RELEASED_FP8) or ".mlp.shared_experts." in name):
            continue
        with torch.device("meta"):
            fp8 = Fp8Linear(linear.in_features, linear.out_features)
        fp8.weight, fp8.weight_scale = quantize_fp8_blocks(linear.weight)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fp8)
