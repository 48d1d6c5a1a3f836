"""Seeded random weights: the per-parameter rule, and whole models drawn in place on a device.

The rule (`random_tensor`) keeps activations O(1) through every layer, so no branch is dead; the tiny
checkpoint (models/tiny.py) writes its weights with it. `draw_weights` fills a model built on the meta
device straight in device memory, in its serving dtype or in the release's formats, with no checkpoint:
a 4-layer V4-Flash-dims slice is 27.4B parameters (55 GB in bf16), which the benchmark machine's disk
could not hold twice. `build_random_model` is that for a config (bench/slice.py); models/dummy_weights.py
is that for a served directory (`model.load_format: dummy`).

Seeds: every parameter has its own generator, seeded from (seed, name), and every routed expert its
own, from (seed, name, expert). So a tensor-parallel rank draws only its own experts and cuts its part
of any other sharded parameter from the whole one it draws: every world size holds the same model,
split as a checkpoint would be. The numbers depend on the generator's device type (CPU and CUDA
generators give different streams), not on which GPU.

Released formats (`released`, models/released_format.py): each tensor is quantized as it is drawn,
an expert or a linear at a time, so peak memory stays near the final size (a full model drawn in bf16
first would not fit where its released form does). Held as the loader holds a released checkpoint with
`model.quantization: checkpoint`: routed experts MXFP4, FP8 linears as Fp8Linear where the rank's shard
cuts whole scale blocks (the grouped o_a_proj too); the other weights the release stores FP8 (shards
that cut a block) hold their FP8-rounded values in the serving dtype, as the loader dequantizes them.
"""

from __future__ import annotations

import hashlib
import math

import torch

from contract.progress import Progress
from kernels.quant import FP8_BLOCK, dequantize_fp8_blocks, quantize_fp8_blocks, quantize_mxfp4
from models.config import ConfigError, ModelConfig
from models.layers import Fp8Linear
from models.loader import (
    ExpertsArrival,
    ExpertsLoaded,
    assign_parameter,
    cuts_whole_blocks,
    fp8_candidates,
    loaded_dtype,
    swap_in_fp8,
)
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.moe import Experts
from models.mtp import attach_mtp
from models.parallel import SINGLE, Shard, TensorParallel, shard_of
from models.released_format import ReleasedFormat, stored_fp8


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
        return keys.argsort(dim=-1)[:, : shape[1]].contiguous()  # a slice: the router would copy it every step
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


def tensor_seed(seed: int, name: str, part: int | None = None) -> int:
    """The generator seed of parameter `name` (and of its expert or block `part`) under `seed`."""
    key = f"{seed}/{name}" + ("" if part is None else f"/{part}")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def seeded(device: str, seed: int, name: str, part: int | None = None) -> torch.Generator:
    return torch.Generator(device).manual_seed(tensor_seed(seed, name, part))


def meta_model(config: ModelConfig, tp: TensorParallel = SINGLE, mtp: bool = False) -> DeepseekV4 | DeepseekV41:
    """The model with every tensor on the meta device, at this rank's shard sizes; with `mtp`, its MTP
    layers too (`model.mtp`, models/mtp.py)."""
    with torch.device("meta"):
        model = DeepseekV41(config, tp) if config.is_v41 else DeepseekV4(config, tp)
        if mtp:
            attach_mtp(model, tp)
    return model


@torch.no_grad()
def draw_weights(
    model: DeepseekV4 | DeepseekV41, seed: int, dtype: torch.dtype, device: str,
    released: ReleasedFormat | None = None, progress: Progress | None = None,
    experts_drawn: ExpertsLoaded | None = None,
) -> None:
    """Fills `model` (from `meta_model`) in place on `device`: each parameter and buffer in the dtype
    the loader gives it (norms, mHC, sinks and biases float32; the rest `dtype`), or in the release's
    formats. Engram tables are not parameters: the caller attaches them. `experts_drawn`: as
    load_model's `experts_loaded`, called once each MoE layer's routed experts are drawn."""
    config = model.config
    arrived = ExpertsArrival(experts_drawn)
    held_fp8 = _swap_in_fp8(model, released) if released is not None else set()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        target = loaded_dtype(name, dtype, tensor.dtype)
        if isinstance(module, Experts):
            _draw_experts(module, leaf, name, tensor.shape, seed, device, target, released)
        elif owner in held_fp8:
            if leaf != "weight":  # its weight_scale, made with the weight
                continue
            _draw_fp8(module, name, shard_of(model, name), seed, device, target)
        else:
            shard = shard_of(model, name)
            value = random_tensor(name, _full_shape(tensor.shape, shard), config.n_routed_experts,
                                  seeded(device, seed, name), target)
            if released is not None and stored_fp8(name) and value.dim() == 2:
                value = dequantize_fp8_blocks(*quantize_fp8_blocks(value, released.fp8_block), released.fp8_block)
            assign_parameter(model, name, _cut(value, shard).to(target))
        if progress is not None:
            progress.update(_held_bytes(model, name))
        if isinstance(module, Experts):  # after the count above: the callback may move them off the device
            arrived.note(model, owner, leaf)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def build_random_model(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0, mtp: bool = False,
) -> DeepseekV4 | DeepseekV41:
    """The model with seeded random weights drawn on `device` (draw_weights), with `mtp` its MTP layers
    too. Engram tables are not built here (models/dummy_weights.py builds them for a served directory)."""
    if config.engram is not None:
        raise ConfigError("build_random_model does not build Engram tables: use a config without engram_layer_ids")
    model = meta_model(config, mtp=mtp)
    draw_weights(model, seed, dtype, device)
    return model.eval()


@torch.no_grad()
def quantize_as_released(model: DeepseekV4 | DeepseekV41) -> None:
    """Puts a model's weights in the release's formats, in place on their device: routed experts MXFP4
    (kept packed); the attention projections and the shared expert FP8 with 128 x 128 block scales
    (Fp8Linear; the grouped o_a_proj too, as the release stores it); what
    `model.quantization: checkpoint` serves from a real checkpoint. One expert at a time, so the
    temporaries stay small next to a 55 GB bf16 slice. (draw_weights' `released` draws a model so
    from the start, without the bf16 copy.)"""
    for module in list(model.modules()):
        if isinstance(module, Experts):
            for leaf in ("gate_up_proj", "down_proj"):
                dense = module.weights(leaf)
                packed = [quantize_mxfp4(dense[e]) for e in range(dense.shape[0])]
                module.keep_packed(leaf, torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed]))
                del dense, packed
    for name, linear in fp8_candidates(model):
        if stored_fp8(f"{name}.weight"):
            weight = linear.weight
            fp8 = swap_in_fp8(model, name, FP8_BLOCK)
            fp8.weight, fp8.weight_scale = quantize_fp8_blocks(weight)


def _swap_in_fp8(model: torch.nn.Module, released: ReleasedFormat) -> set[str]:
    """The linears the loader would hold as Fp8Linear for a released checkpoint: stored FP8, and this
    rank's shard (if any) one run of whole blocks. Swapped in (meta); returns their names."""
    held = set()
    for name, _ in fp8_candidates(model):
        weight = f"{name}.weight"
        if stored_fp8(weight) and cuts_whole_blocks(shard_of(model, weight), released.fp8_block):
            swap_in_fp8(model, name, released.fp8_block)
            held.add(name)
    return held


def _draw_fp8(module: Fp8Linear, name: str, shard: Shard | None, seed: int, device: str, dtype: torch.dtype) -> None:
    """The whole weight drawn as the unquantized model draws it and quantized on the whole tensor's block
    grid, then this rank's values and scales cut from it: what a rank reads of a released checkpoint."""
    full = _full_shape(torch.Size((module.out_features, module.in_features)), shard)
    values, scales = quantize_fp8_blocks(random_tensor(name, full, 0, seeded(device, seed, name), dtype), module.block)
    if shard is not None:
        (start, end), block = shard.ranges[0], module.block
        values = values.narrow(shard.dim, start, end - start)
        scales = scales.narrow(shard.dim, start // block, -(-end // block) - start // block)
    module.weight, module.weight_scale = values.contiguous(), scales.contiguous()


def _draw_experts(module: Experts, leaf: str, name: str, shape: torch.Size, seed: int, device: str,
                  dtype: torch.dtype, released: ReleasedFormat | None) -> None:
    """This rank's experts of `leaf` (gate_up_proj / down_proj), each from its own generator; MXFP4
    (packed as it is drawn) in the released format with packed experts."""
    owned = range(module.first, module.first + module.held)
    packed = released is not None and released.packed_experts
    if not packed:
        out = torch.empty(shape, dtype=dtype, device=device)
        for local, expert in enumerate(owned):
            out[local] = _expert(name, shape, seed, device, dtype, expert)
            if released is not None:  # FP8 experts: the loader dequantizes them
                block = released.fp8_block
                out[local] = dequantize_fp8_blocks(*quantize_fp8_blocks(out[local], block), block)
        assign_parameter(module, leaf, out)
        return
    held, rows, cols = shape
    codes = torch.empty((held, rows, cols // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((held, rows, cols // 32), dtype=torch.uint8, device=device)
    for local, expert in enumerate(owned):
        codes[local], scales[local] = quantize_mxfp4(_expert(name, shape, seed, device, dtype, expert))
    module.keep_packed(leaf, codes, scales)


def _expert(name: str, shape: torch.Size, seed: int, device: str, dtype: torch.dtype, expert: int) -> torch.Tensor:
    """Routed expert `expert` of `name` (the stacked [experts, rows, cols] shape), from its own generator."""
    return random_tensor(name, shape[1:], 0, seeded(device, seed, name, expert), dtype)  # 0: no tid2eid here


def _full_shape(shape: torch.Size, shard: Shard | None) -> torch.Size:
    if shard is None:
        return shape
    full = list(shape)
    full[shard.dim] = shard.full
    return torch.Size(full)


def _cut(value: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a whole tensor (its shard's ranges along the shard's dim, in order)."""
    if shard is None:
        return value
    return torch.cat([value.narrow(shard.dim, start, end - start) for start, end in shard.ranges], dim=shard.dim)


def _held_bytes(model: torch.nn.Module, name: str) -> int:
    """Bytes `name`'s module holds for it now (its FP8 scales or MXFP4 exponents with it)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    held = [t for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            if n == leaf or n.startswith(f"{leaf}_")]
    return sum(t.numel() * t.element_size() for t in held)
