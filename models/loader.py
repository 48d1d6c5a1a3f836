"""Checkpoint loading: safetensors (single file or sharded with an index), HF weight names.

Quantized weights are dequantized at load into the serving dtype (the CPU reference path):
- FP8 block-scaled: float8_e4m3fn `X` with `X_scale_inv` (HF fine-grained FP8) or `<module>.scale`
  (original release), one scale per 128x128 block;
- MXFP4: packed E2M1 bytes `X` ([..., in/2]) with E8M0 scales `X_scale` / `<module>.scale`
  ([..., in/32]), or gpt-oss style `X_blocks` / `X_scales`.
Every parameter must be present with its exact shape; anything else in the files is an error, except
the MTP layer (`mtp.*`), which serving does not run. Errors name the tensor and the file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engram_store.store import EngramOptions
from kernels import dequantize_fp8_blocks, dequantize_mxfp4
from models.config import ConfigError, ModelConfig
from models.engram_setup import engram_memory
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.weight_names import NameIndex

IGNORED_PREFIXES = ("mtp.",)
# Parameters the release keeps in float32 whatever the serving dtype (norms, mHC, sinks, biases).
FLOAT32_MARKERS = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.", "engram.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor and file."""


class TensorSource:
    """Name -> file map over one or more safetensors files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:  # a lone model.safetensors is the checkpoint; other files beside it are not weights
            single = directory / "model.safetensors"
            files = [single] if single.exists() else sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files")
            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    self.files.update({name: file for name in handle.keys()})
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self._handles:
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index for {name!r} but missing")
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_tensor(name)

    def where(self, name: str) -> str:
        return str(self.files.get(name, self.directory))


def _module_scale_name(name: str) -> str | None:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None


class WeightReader:
    """Reads one parameter by name, dequantizing it if the checkpoint stores it quantized."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.consumed: set[str] = set()

    def read(self, name: str, shape: torch.Size) -> torch.Tensor:
        """`name` is the stored name; scale companions are found beside it."""
        names = self.source.names()
        if name + "_blocks" in names and name + "_scales" in names:
            blocks = self._take(name + "_blocks")
            packed = blocks.reshape(*blocks.shape[:-2], -1)
            return self._checked(name, dequantize_mxfp4(packed, self._take(name + "_scales")), shape)
        if name not in names:
            raise CheckpointError(f"missing tensor {name!r} in {self.source.directory}")
        tensor = self._take(name)
        scale_name = next(
            (n for n in (name + "_scale_inv", name + "_scale", _module_scale_name(name)) if n and n in names), None
        )
        if scale_name is None:
            return self._checked(name, tensor, shape)
        scale = self._take(scale_name)
        if tensor.dtype == torch.float8_e4m3fn:
            return self._checked(name, dequantize_fp8_blocks(tensor, scale), shape)
        if tensor.shape[-1] * 2 == shape[-1]:
            return self._checked(name, dequantize_mxfp4(tensor, scale), shape)
        raise CheckpointError(
            f"tensor {name!r} in {self.source.where(name)} has scale {scale_name!r} but is neither FP8 "
            f"nor packed FP4 for shape {tuple(shape)} (stored {tuple(tensor.shape)}, {tensor.dtype})"
        )

    def read_engram_table(self, layer: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [rows, head_dim], scales [rows, head_dim / block]) of `model.engram_tables.<layer>`,
        as stored: fp8 values with power-of-two scales, or float rows (with a unit scale column)."""
        name = f"model.engram_tables.{layer}.weight"
        names = self.source.names()
        if name not in names:
            raise CheckpointError(f"missing tensor {name!r} in {self.source.directory}")
        values = self._take(name)
        scale_name = next((n for n in (name + "_scale_inv", name[: -len("weight")] + "scale") if n in names), None)
        scales = self._take(scale_name) if scale_name else torch.ones(values.shape[0], 1)
        if values.dim() != 2 or values.shape[1] != head_dim or scales.shape[0] != values.shape[0] or head_dim % scales.shape[1]:
            raise CheckpointError(
                f"tensor {name!r} in {self.source.where(name)} has shape {tuple(values.shape)} with scales "
                f"{tuple(scales.shape)}; expected [rows, {head_dim}] and [rows, {head_dim} / block]"
            )
        return values, scales

    def _take(self, name: str) -> torch.Tensor:
        self.consumed.add(name)
        return self.source.get(name)

    def _checked(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {self.source.where(name)} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(shape)}"
            )
        return tensor


def _target_dtype(name: str, dtype: torch.dtype, stored: torch.dtype) -> torch.dtype:
    if not stored.is_floating_point:
        return stored
    return torch.float32 if any(marker in name for marker in FLOAT32_MARKERS) else dtype


def load_model(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    simulate_quantization: bool = True,
    engram: EngramOptions | None = None,
) -> DeepseekV4 | DeepseekV41:
    """`simulate_quantization=False` turns V4.1's in-forward fp8/fp4 rounding off (reference comparisons).
    `engram` places each Engram table in its tier (engram_store/); None reads them all into memory."""
    directory = Path(directory)
    config = ModelConfig.from_file(directory / "config.json")
    if config.is_v41 and not simulate_quantization:
        config = replace(config, simulate_quantization=False)
    with torch.device("meta"):
        model = DeepseekV41(config) if config.is_v41 else DeepseekV4(config)
    reader = WeightReader(TensorSource(directory))
    index = NameIndex.build(reader.source.names(), module_names=config.is_v41)
    for full_name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if full_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = _read_parameter(reader, index, full_name, tensor.shape)
        value = value.to(device=device, dtype=_target_dtype(full_name, dtype, value.dtype))
        _assign(model, full_name, value)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if config.engram is not None:
        try:
            model.engram_memory = engram_memory(config.engram, directory, reader.read_engram_table, device, engram)
        except ConfigError as exc:
            raise CheckpointError(f"{directory}: {exc}") from exc
    ignored = IGNORED_PREFIXES + (("model.engram_tables.",) if config.engram is not None else ())  # disk tiers read files
    unexpected = sorted(name for name in reader.source.names() - reader.consumed if not name.startswith(ignored))
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5])
        raise CheckpointError(f"unexpected tensors in {directory} not used by the model: {shown}"
                              + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    return model.eval()


def _read_parameter(reader: WeightReader, index: NameIndex, name: str, shape: torch.Size) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    if name not in index.direct and owner in index.experts and leaf in ("gate_up_proj", "down_proj"):
        return _stack_experts(reader, index.experts[owner].by_expert, owner, leaf, shape)
    return reader.read(index.direct.get(name, name), shape)


def _stack_experts(
    reader: WeightReader, parts: dict[int, dict[str, str]], owner: str, leaf: str, shape: torch.Size
) -> torch.Tensor:
    n_experts = shape[0]
    matrices = []
    for expert in range(n_experts):
        stored = parts.get(expert, {})
        wanted = ("w1", "w3") if leaf == "gate_up_proj" else ("w2",)
        missing = [w for w in wanted if w not in stored]
        if missing:
            raise CheckpointError(f"missing tensor {owner}.{expert}.{missing[0]}.weight in {reader.source.directory}")
        rows = shape[1] // len(wanted)
        matrices.append(torch.cat([reader.read(stored[w], torch.Size((rows, shape[2]))) for w in wanted]))
    return torch.stack(matrices)


def _assign(model: nn.Module, full_name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = full_name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
