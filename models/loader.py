"""Checkpoint loading: safetensors (single file or sharded with an index), HF weight names.

Quantized weights are dequantized at load into the serving dtype (the CPU reference path):
- FP8 block-scaled: float8_e4m3fn `X` with `X_scale_inv` (HF fine-grained FP8) or `<module>.scale`
  (original release), one scale per block of config.json's `weight_block_size` (128x128 by default,
  32x32 in V4.1-Flash);
- MXFP4: packed E2M1 bytes `X` ([..., in/2]) with E8M0 scales `X_scale` / `<module>.scale`
  ([..., in/32]), or gpt-oss style `X_blocks` / `X_scales`.
Every parameter must be present with its exact shape; anything else in the files is an error, except
the MTP layers (`mtp.*`) unless `mtp` asks for them (models/mtp.py: `model.mtp`, read as the layers
are, in any of the formats above). Errors name the tensor and the file.

`keep_quantized` (`model.quantization: checkpoint`) keeps them as stored instead where the GPU path
reads them so: FP8 linears (attention's grouped o_a_proj included) become `Fp8Linear` (models/layers.py)
and MXFP4 routed experts stay packed
(`Experts.keep_packed`); a tensor stored otherwise, or cut by a tensor-parallel shard inside a scale
block, is dequantized as above.

Tensor parallel (`tp`): the model is built at this rank's shard sizes and each sharded parameter is
read as its slice of the stored tensor (safetensors `get_slice`; quantized ones by the scale blocks
that cover the slice), so a rank never reads the parts other ranks hold; other ranks' per-expert
tensors are not read at all. Replicated parameters are read whole on every rank.

Progress (contract/progress.py): rank 0 shows the bytes read as they are read, out of the checkpoint's
tensor bytes (from the files' headers) on one rank; with several ranks each reads only its shards, so the
bar shows bytes and rate without a total. Engram tables are read after it, one read per table.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from contract.progress import Progress
from engram_store.store import EngramOptions
from kernels import dequantize_fp8_blocks, dequantize_mxfp4
from kernels.quant import FP8_BLOCK, MXFP4_BLOCK, _as_float_scales
from models.config import ConfigError, ModelConfig
from models.csa2 import SharedCompressor
from models.engram_setup import TableRows, engram_memory
from models.layers import Fp8Linear, GroupedLinear
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.moe import Experts
from models.mtp import attach_mtp
from models.parallel import SINGLE, Shard, TensorParallel, shard_of
from models.weight_names import NameIndex

log = logging.getLogger("ds4serve.models")

IGNORED_PREFIXES = ("mtp.",)
CPU_ALIGNMENT = 64  # bytes: what torch's own CPU allocations give (see assign_parameter)
# Parameters the release keeps in float32 whatever the serving dtype (norms, mHC, sinks, biases).
FLOAT32_MARKERS = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.", "engram.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor and file."""


class TensorSource:
    """Name -> file map over one or more safetensors files; reads whole tensors or slices of them and
    counts the bytes it read."""

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
        self.bytes_read = 0

    def names(self) -> set[str]:
        return set(self.files)

    def stored_bytes(self, skip: tuple[str, ...] = ()) -> int:
        """Bytes of the stored tensors whose names do not start with `skip`, from the files' headers
        (reads no tensor)."""
        sizes: dict[str, int] = {}
        for file in set(self.files.values()):
            if file.exists():
                sizes.update(_header_bytes(file))
        return sum(size for name, size in sizes.items() if name in self.files and not name.startswith(skip))

    def get(self, name: str) -> torch.Tensor:
        return self._counted(self._handle(name).get_tensor(name))

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        """[start, end) along `dim` of the stored tensor, reading only that part of the file."""
        return self._counted(self._handle(name).get_slice(name)[(slice(None),) * dim + (slice(start, end),)])

    def stored(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype name) of a stored tensor, without reading it."""
        handle = self._handle(name).get_slice(name)
        return tuple(handle.get_shape()), handle.get_dtype()

    def where(self, name: str) -> str:
        return str(self.files.get(name, self.directory))

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index for {name!r} but missing")
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _header_bytes(file: Path) -> dict[str, int]:
    """Each tensor's byte length in one safetensors file, from its JSON header (8-byte length, then JSON)."""
    with open(file, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return {name: entry["data_offsets"][1] - entry["data_offsets"][0]
            for name, entry in header.items() if name != "__metadata__"}


def _module_scale_name(name: str) -> str | None:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None


def _unpack_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(blocks.reshape(*blocks.shape[:-2], -1), scales)


@dataclass(frozen=True)
class StoredFormat:
    """How one parameter is stored: its values, the scales beside them (if any) and how to decode the
    pair. A slice is read as the whole scale blocks that cover it: `block(dim)` logical elements share
    one scale along `dim`, and `per_value(dim)` logical elements share one stored value index there."""

    values: str
    scale: str | None
    decode: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    blocked_dims: int  # trailing dims the scales are blocked along (FP8: 2, MXFP4: 1)
    scale_block: int
    packing: int  # logical elements per stored index along the last dim (packed FP4: 2, gpt-oss blocks: 32)
    kind: str = "plain"  # "fp8", "mxfp4" (packed pairs), "mxfp4_blocks" (gpt-oss) or "plain"

    def block(self, dim: int, ndim: int) -> int:
        return self.scale_block if dim >= ndim - self.blocked_dims else 1

    def per_value(self, dim: int, ndim: int) -> int:
        return self.packing if dim == ndim - 1 else 1

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        if self.packing == 1:
            return stored
        if self.packing == 2:
            return (*stored[:-1], stored[-1] * 2)
        return (*stored[:-2], stored[-2] * stored[-1] * 2)  # gpt-oss blocks [..., in / 32, 16]


class WeightReader:
    """Reads one parameter (or one rank's shard of it) by name, dequantizing it if the checkpoint
    stores it quantized."""

    def __init__(self, source: TensorSource, fp8_block: int = FP8_BLOCK) -> None:
        self.source = source
        self.fp8_block = fp8_block  # side of the square FP8 scale blocks (config.json's weight_block_size)
        self.consumed: set[str] = set()

    def read(self, name: str, shape: torch.Size, shard: Shard | None = None) -> torch.Tensor:
        """`name` is the stored name; scale companions are found beside it. `shape` is what the model
        holds: the shard's shape when `shard` says which part of the stored tensor that is."""
        full = list(shape)
        if shard is not None:
            full[shard.dim] = shard.full
        stored = self._format(name, tuple(full))
        if shard is None:
            scale = self._take(stored.scale) if stored.scale else None
            return self._checked(name, stored.decode(self._take(stored.values), scale), shape)
        logical = stored.logical_shape(self.source.stored(stored.values)[0])
        if logical != tuple(full):
            raise CheckpointError(
                f"tensor {name!r} in {self.source.where(name)} has shape {logical}, the model expects {tuple(full)}"
            )
        pieces = [self._read_range(stored, shard.dim, start, end, logical) for start, end in shard.ranges]
        return self._checked(name, torch.cat(pieces, dim=shard.dim), shape)

    def read_stored(self, name: str, shape: torch.Size, shard: Shard | None, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(values, scales) of `name` as stored when it is stored as `kind` ("fp8": float8_e4m3fn with
        float32 block scales; "mxfp4": uint8 codes with uint8 E8M0 exponents) and `shard` cuts it at
        whole scale blocks; None otherwise, reading nothing (the caller dequantizes instead)."""
        full = list(shape)
        if shard is not None:
            full[shard.dim] = shard.full
        stored = self._format(name, tuple(full))
        wanted = ("fp8",) if kind == "fp8" else ("mxfp4", "mxfp4_blocks")
        if stored.kind not in wanted or stored.scale is None:
            return None
        if kind == "mxfp4" and self.source.stored(stored.scale)[1] not in ("U8", "F8_E8M0"):
            return None
        if shard is None:
            values, scale = self._take(stored.values), self._take(stored.scale)
        else:
            block, per_value = stored.block(shard.dim, len(full)), stored.per_value(shard.dim, len(full))
            if len(shard.ranges) != 1 or shard.dim == len(full) - 1 and stored.kind == "mxfp4_blocks":
                return None
            start, end = shard.ranges[0]
            if start % block or (end % block and end != shard.full):
                return None
            values = self._take_slice(stored.values, shard.dim, start // per_value, -(-end // per_value))
            scale = self._take_slice(stored.scale, shard.dim, start // block, -(-end // block))
        if kind == "fp8":
            return values, _as_float_scales(scale)
        if stored.kind == "mxfp4_blocks":  # gpt-oss blocks [..., in / 32, 16] -> [..., in / 2]
            values = values.reshape(*values.shape[:-2], -1)
        return values.view(torch.uint8), scale.view(torch.uint8)

    def skip(self, name: str) -> None:
        """Marks a tensor another rank reads (and its scales) as accounted for, without reading it."""
        companions = (name, name + "_blocks", name + "_scales", name + "_scale_inv", name + "_scale",
                      _module_scale_name(name))
        self.consumed.update(n for n in companions if n in self.source.files)

    def read_engram_table(self, rows: TableRows, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(values [rows, head_dim], scales [rows, head_dim / block], rows stored) of the wanted rows of
        `model.engram_tables.<layer>`, as stored: fp8 values with power-of-two scales, or float rows
        (with a unit scale column)."""
        name = f"model.engram_tables.{rows.layer}.weight"
        names = self.source.names()
        if name not in names:
            raise CheckpointError(f"missing tensor {name!r} in {self.source.directory}")
        stored_rows = self.source.stored(name)[0][0]
        values = self._take_slice(name, 0, rows.start, rows.end)
        scale_name = next((n for n in (name + "_scale_inv", name[: -len("weight")] + "scale") if n in names), None)
        scales = self._take_slice(scale_name, 0, rows.start, rows.end) if scale_name else torch.ones(len(values), 1)
        if values.dim() != 2 or values.shape[1] != head_dim or scales.shape[0] != values.shape[0] or head_dim % scales.shape[1]:
            raise CheckpointError(
                f"tensor {name!r} in {self.source.where(name)} has shape {tuple(values.shape)} with scales "
                f"{tuple(scales.shape)}; expected [rows, {head_dim}] and [rows, {head_dim} / block]"
            )
        return values, scales, stored_rows

    def _format(self, name: str, shape: tuple[int, ...]) -> StoredFormat:
        names = self.source.names()
        if name + "_blocks" in names and name + "_scales" in names:
            return StoredFormat(name + "_blocks", name + "_scales", _unpack_blocks, 1, MXFP4_BLOCK, MXFP4_BLOCK,
                                "mxfp4_blocks")
        if name not in names:
            raise CheckpointError(f"missing tensor {name!r} in {self.source.directory}")
        scale = next(
            (n for n in (name + "_scale_inv", name + "_scale", _module_scale_name(name)) if n and n in names), None
        )
        if scale is None:
            return StoredFormat(name, None, lambda values, _: values, 0, 1, 1)
        stored_shape, stored_dtype = self.source.stored(name)
        if stored_dtype == "F8_E4M3":
            decode = functools.partial(dequantize_fp8_blocks, block=self.fp8_block)
            return StoredFormat(name, scale, decode, 2, self.fp8_block, 1, "fp8")
        if stored_shape[-1] * 2 == shape[-1]:
            return StoredFormat(name, scale, dequantize_mxfp4, 1, MXFP4_BLOCK, 2, "mxfp4")
        raise CheckpointError(
            f"tensor {name!r} in {self.source.where(name)} has scale {scale!r} but is neither FP8 "
            f"nor packed FP4 for shape {shape} (stored {stored_shape}, {stored_dtype})"
        )

    def _read_range(
        self, stored: StoredFormat, dim: int, start: int, end: int, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """[start, end) along `dim`, decoded: reads the whole scale blocks that cover it, then trims."""
        block, per_value = stored.block(dim, len(shape)), stored.per_value(dim, len(shape))
        low, high = start - start % block, min(-(-end // block) * block, shape[dim])
        values = self._take_slice(stored.values, dim, low // per_value, -(-high // per_value))
        scale = self._take_slice(stored.scale, dim, low // block, -(-high // block)) if stored.scale else None
        return stored.decode(values, scale).narrow(dim, start - low, end - start)

    def _take(self, name: str) -> torch.Tensor:
        self.consumed.add(name)
        return self.source.get(name)

    def _take_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        self.consumed.add(name)
        return self.source.get_slice(name, dim, start, end)

    def _checked(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {self.source.where(name)} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(shape)}"
            )
        return tensor


def loaded_dtype(name: str, dtype: torch.dtype, stored: torch.dtype) -> torch.dtype:
    """The dtype a dequantized parameter is held in: the serving `dtype`, float32 where the release keeps
    float32 (FLOAT32_MARKERS), integers as stored. The static plan and the dummy and random builders count
    and build with this same rule."""
    if not stored.is_floating_point:
        return stored
    return torch.float32 if any(marker in name for marker in FLOAT32_MARKERS) else dtype


def load_model(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    simulate_quantization: bool = True,
    engram: EngramOptions | None = None,
    tp: TensorParallel = SINGLE,
    keep_quantized: bool = False,
    tokenizer_dir: Path | None = None,
    mtp: bool = False,
    experts_loaded: ExpertsLoaded | None = None,
) -> DeepseekV4 | DeepseekV41:
    """`simulate_quantization=False` turns V4.1's in-forward fp8/fp4 rounding off (reference comparisons).
    `engram` places each Engram table in its tier (engram_store/); None reads them all into memory.
    `tp` loads this rank's shards only (a ConfigError names a size the world size does not divide).
    `keep_quantized`: FP8 linears and MXFP4 experts stay as stored (see the module docstring).
    `tokenizer_dir`: where V4.1's Engram hashing finds tokenizer.json (default: the checkpoint's).
    `mtp`: also load the MTP layers as `model.mtp` (a CheckpointError when the config has none).
    `experts_loaded(model, moe_name)`: called once a MoE layer's routed experts are in memory, before
    the next layer's are read, so they can move out of the device (expert offload) as they arrive."""
    directory = Path(directory)
    config = ModelConfig.from_file(directory / "config.json")
    if config.is_v41 and not simulate_quantization:
        config = replace(config, simulate_quantization=False)
    with torch.device("meta"):
        model = DeepseekV41(config, tp) if config.is_v41 else DeepseekV4(config, tp)
        if mtp:
            try:
                attach_mtp(model, tp)
            except ConfigError as exc:
                raise CheckpointError(f"{directory}: {exc}") from exc
    reader = WeightReader(TensorSource(directory), fp8_block(directory / "config.json"))
    index = NameIndex.build(reader.source.names(), module_names=config.is_v41)
    fp8_modules = _fp8_linears(model, reader, index) if keep_quantized else set()
    ignored = () if mtp else IGNORED_PREFIXES
    if config.engram is not None:
        ignored += ("model.engram_tables.",)  # disk tiers read files
    total = reader.source.stored_bytes(ignored) if tp.world_size == 1 else None
    arrived = ExpertsArrival(experts_loaded)
    with Progress(f"loading {directory.name}", total, log, enabled=tp.rank == 0) as progress:
        for full_name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            progress.update(reader.source.bytes_read - progress.done)  # what the parameter before read
            if full_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            owner, _, leaf = full_name.rpartition(".")
            if owner in fp8_modules:
                if leaf == "weight":
                    stored = index.direct.get(full_name, full_name)
                    values, scale = reader.read_stored(stored, tensor.shape, shard_of(model, full_name), "fp8")
                    assign_parameter(model, full_name, values.to(device))
                    assign_parameter(model, f"{owner}.weight_scale", scale.to(device))
                continue
            experts = model.get_submodule(owner) if isinstance(model.get_submodule(owner), Experts) else None
            packed = None
            if keep_quantized and experts is not None:
                packed = read_packed_experts(reader, index, full_name, tensor.shape, shard_of(model, full_name))
            if packed is not None:
                experts.keep_packed(leaf, packed[0].to(device), packed[1].to(device))
            else:
                value = read_parameter(reader, index, full_name, tensor.shape, shard_of(model, full_name))
                value = value.to(device=device, dtype=loaded_dtype(full_name, dtype, value.dtype))
                assign_parameter(model, full_name, value)
            if experts is not None:
                arrived.note(model, owner, leaf)
        progress.update(reader.source.bytes_read - progress.done)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if config.engram is not None:
        try:
            model.engram_memory = engram_memory(config.engram, directory, reader.read_engram_table, device, engram, tp,
                                                tokenizer_dir=tokenizer_dir)
        except ConfigError as exc:
            raise CheckpointError(f"{directory}: {exc}") from exc
    unexpected = sorted(name for name in reader.source.names() - reader.consumed if not name.startswith(ignored))
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5])
        raise CheckpointError(f"unexpected tensors in {directory} not used by the model: {shown}"
                              + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    log.info("%s: rank %d of %d read %.1f MiB of weights", directory, tp.rank, tp.world_size,
             reader.source.bytes_read / 2**20)
    return model.eval()


def fp8_block(config_json: Path) -> int:
    """The side of the FP8 weights' scale blocks: config.json's quantization_config.weight_block_size
    (at the top or in V4.1's text_config; 128 x 128 when absent, 32 x 32 in V4.1-Flash). Only square
    blocks are read."""
    raw = json.loads(config_json.read_text())
    quant = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config") or {}
    block = quant.get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK)
    if len(block) != 2 or block[0] != block[1] or int(block[0]) <= 0:
        raise CheckpointError(f"{config_json}: quantization_config.weight_block_size {list(block)}: only square"
                              " FP8 blocks are supported")
    return int(block[0])


def _fp8_linears(model: nn.Module, reader: WeightReader, index: NameIndex) -> set[str]:
    """Puts an Fp8Linear where each nn.Linear stands whose checkpoint weight is FP8 (and whose shard,
    if any, cuts whole blocks); returns their names. A kv source's compressor reads its projections'
    weights in float32 directly, so those stay dequantized."""
    replaced = set()
    for name, module in fp8_candidates(model):
        stored = index.direct.get(f"{name}.weight", f"{name}.weight")
        shard = shard_of(model, f"{name}.weight")
        if stored not in reader.source.names() or not stored_fp8_linear(reader, stored, module, shard):
            continue
        swap_in_fp8(model, name, reader.fp8_block)
        replaced.add(name)
    return replaced


def swap_in_fp8(model: nn.Module, name: str, block: int) -> Fp8Linear:
    """Puts an empty (meta) Fp8Linear of `block` x `block` scale blocks where the nn.Linear `name` stands,
    with its shard record; returns it."""
    linear = model.get_submodule(name)
    groups = linear.groups if isinstance(linear, GroupedLinear) else 1
    with torch.device("meta"):
        fp8 = Fp8Linear(linear.in_features, linear.out_features, block, groups)
    if hasattr(linear, "tp_shards"):
        fp8.tp_shards = linear.tp_shards
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, fp8)
    return fp8


def fp8_candidates(model: nn.Module) -> list[tuple[str, nn.Linear | GroupedLinear]]:
    """The linear layers that may run as Fp8Linear: every bias-free nn.Linear but a kv source
    compressor's projections, whose weights it reads in float32 directly, and every GroupedLinear."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedLinear) or (type(module) is nn.Linear and module.bias is None):
            if not isinstance(model.get_submodule(name.rpartition(".")[0]), SharedCompressor):
                out.append((name, module))
    return out


def stored_fp8_linear(reader: WeightReader, stored: str, module: nn.Linear | GroupedLinear, shard: Shard | None) -> bool:
    """Whether the checkpoint stores this linear's weight as block-scaled FP8 that the shard (if any)
    cuts at whole blocks."""
    full = [module.out_features, module.in_features]
    if shard is not None:
        full[shard.dim] = shard.full
    if reader._format(stored, tuple(full)).kind != "fp8":
        return False
    return cuts_whole_blocks(shard, reader.fp8_block)


def cuts_whole_blocks(shard: Shard | None, block: int) -> bool:
    """Whether a rank's shard (None: the whole tensor) is one run of whole scale blocks, so its FP8
    values and scales can be held as stored; otherwise the shard is dequantized."""
    if shard is None:
        return True
    start, end = shard.ranges[0]
    return len(shard.ranges) == 1 and start % block == 0 and (end % block == 0 or end == shard.full)


def read_packed_experts(
    reader: WeightReader, index: NameIndex, name: str, shape: torch.Size, shard: Shard | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's gate_up_proj / down_proj as stacked MXFP4 codes and exponents, when the checkpoint
    stores every expert's part so; None to dequantize instead."""
    owner, _, leaf = name.rpartition(".")
    if name in index.direct or owner not in index.experts:
        return reader.read_stored(index.direct.get(name, name), shape, shard, "mxfp4")
    parts = index.experts[owner].by_expert
    owned = range(shard.start, shard.start + shard.size) if shard is not None else range(shape[0])
    wanted = ("w1", "w3") if leaf == "gate_up_proj" else ("w2",)
    rows = shape[1] // len(wanted)
    if any(w not in parts.get(e, {}) for e in owned for w in wanted):
        return None
    codes, scales = [], []
    for expert in owned:
        pieces = [reader.read_stored(parts[expert][w], torch.Size((rows, shape[2])), None, "mxfp4") for w in wanted]
        if any(p is None for p in pieces):
            return None
        codes.append(torch.cat([p[0] for p in pieces]))
        scales.append(torch.cat([p[1] for p in pieces]))
    total = shard.full if shard is not None else shape[0]
    for expert in range(total):
        if expert not in owned:
            for w in wanted:
                if w in parts.get(expert, {}):
                    reader.skip(parts[expert][w])
    return torch.stack(codes), torch.stack(scales)


def read_parameter(
    reader: WeightReader, index: NameIndex, name: str, shape: torch.Size, shard: Shard | None
) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    if name not in index.direct and owner in index.experts and leaf in ("gate_up_proj", "down_proj"):
        owned = range(shard.start, shard.start + shard.size) if shard is not None else range(shape[0])
        total = shard.full if shard is not None else shape[0]
        return _stack_experts(reader, index.experts[owner].by_expert, owner, leaf, shape, owned, total)
    return reader.read(index.direct.get(name, name), shape, shard)


def _stack_experts(
    reader: WeightReader, parts: dict[int, dict[str, str]], owner: str, leaf: str, shape: torch.Size,
    owned: range, total: int,
) -> torch.Tensor:
    """The per-expert matrices of the `owned` experts stacked; the model's other experts (of `total`)
    are other ranks' and are skipped unread."""
    wanted = ("w1", "w3") if leaf == "gate_up_proj" else ("w2",)
    for expert in range(total):
        if expert not in owned:
            for w in wanted:
                if w in parts.get(expert, {}):
                    reader.skip(parts[expert][w])
    matrices = []
    for expert in owned:
        stored = parts.get(expert, {})
        missing = [w for w in wanted if w not in stored]
        if missing:
            raise CheckpointError(f"missing tensor {owner}.{expert}.{missing[0]}.weight in {reader.source.directory}")
        rows = shape[1] // len(wanted)
        matrices.append(torch.cat([reader.read(stored[w], torch.Size((rows, shape[2]))) for w in wanted]))
    return torch.stack(matrices)


ExpertsLoaded = Callable[[nn.Module, str], None]


class ExpertsArrival:
    """Tells `experts_loaded` (if any) the name of each MoE module whose Experts have both projections."""

    LEAVES = frozenset({"gate_up_proj", "down_proj"})

    def __init__(self, experts_loaded: ExpertsLoaded | None) -> None:
        self.experts_loaded = experts_loaded
        self.seen: dict[str, set[str]] = {}

    def note(self, model: nn.Module, experts_name: str, leaf: str) -> None:
        seen = self.seen.setdefault(experts_name, set())
        seen.add(leaf)
        if seen == self.LEAVES and self.experts_loaded is not None:
            self.experts_loaded(model, experts_name.rpartition(".")[0])


def assign_parameter(model: nn.Module, full_name: str, value: torch.Tensor) -> None:
    """Puts `value` where `full_name` stands. A host tensor the reader left at an address that is not
    64-byte aligned (a view into the checkpoint's bytes, whose offsets safetensors aligns to 8) is
    copied to a fresh, aligned allocation: CPU GEMMs pick their vector paths, and so their rounding, by
    their operands' alignment, so where the bytes happen to lie must not change a result."""
    if value.device.type == "cpu" and value.data_ptr() % CPU_ALIGNMENT:
        value = value.clone()
    module_name, _, leaf = full_name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
