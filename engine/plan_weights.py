"""Weight bytes of a checkpoint's model, counted on torch's meta device from config.json alone.

The model is instantiated from config.json on the meta device, so the parameter list is the serving
code's own (models/), not a hand formula that drifts from it; no weight is read. A parameter's bytes
follow the format the server holds it in (`model.quantization`):
- none: the loader's dtype rule (models/loader.py): the serving dtype, float32 where the release keeps
  float32 (norms, mHC, sinks, biases, Engram fusion). This is what the engine of this version loads.
- checkpoint: as the release stores it, per config.json's `quantization_config`: routed experts MXFP4
  (`expert_dtype` fp4: E2M1 pairs plus one ue8m0 scale per 32) or FP8; the attention projections, the
  shared expert and Engram's wkv FP8 e4m3 with one scale per `weight_block_size` block (ue8m0: 1 byte,
  else float32); everything else as `none` holds it (models/released_format.py lists which). That split
  reproduces the published V4.1-Flash safetensors headers group by group (tests/test_deploy_plan.py).
  Dummy weights (`model.load_format: dummy`) are counted the same, from config.json alone: there are no
  files to read; a config.json without quantization_config counts the release's defaults (`RELEASED`:
  128 x 128 blocks, MXFP4 experts), which is what dummy weights in the released format then hold.
Engram tables are not weights here: they live in their own tiers (engine/plan.py).
A DSpark draft (`draft_tensors`, --speculative-config method dspark) is counted as the engine holds it,
from its own config.json: models/dspark.py builds it on the meta device as load_dspark holds a
checkpoint in the release's formats (with `checkpoint`: FP8 linears with float32 block scales, MXFP4
experts), so its figure is the loaded draft's bytes, not the files'.

Across tensor-parallel ranks, the sharding of issue 9: routed experts (expert parallel), the q / o
projections, the shared expert, the embedding and the head are split; everything else is replicated.
Lives in server/ only as the `plan` command's helper: it touches torch, but only on the meta device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.quant import FP8_BLOCK
from models.config import ConfigError, ModelConfig
from models.dspark import DSparkConfig, held_draft, held_tensor_bytes
from models.loader import loaded_dtype  # the loader's own dtype rule, so both count the same bytes
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.mtp import attach_mtp
from models.released_format import ReleasedFormat, stored_fp8

# (kind, name fragments), first match wins; names are transformers' module names (models/).
KINDS = (
    ("DSpark draft layers", ("dspark.",)),  # --speculative-config method dspark (model.dspark.mtp.*)
    ("MTP draft layer", ("mtp.",)),  # speculative decoding's (--speculative-config method mtp)
    ("routed experts", (".mlp.experts.",)),
    ("shared expert", (".mlp.shared_experts.",)),
    ("router", (".mlp.gate.",)),
    ("compressor / indexer", (".self_attn.compressor.", ".self_attn.indexer.")),
    ("attention", (".self_attn.",)),
    ("Engram fusion", (".engram.",)),
    ("embedding / head", ("embed_tokens.", "lm_head.")),
    ("norms / mHC", ("",)),
)
SHARDED = (".mlp.experts.", ".self_attn.q_b_proj.", ".self_attn.o_a_proj.", ".self_attn.o_b_proj.",
           ".mlp.shared_experts.", "embed_tokens.", "lm_head.")
MX_BLOCK = 32  # MXFP4: one power-of-two scale per 32 values


@dataclass(frozen=True)
class StoredFormat:
    """How a checkpoint stores its quantized weights (config.json's quantization_config)."""

    fp8_block: tuple[int, int] | None  # None: no FP8 weights
    scale_bytes: int  # per FP8 block scale: ue8m0 1, float32 4
    experts: str  # "fp4", "fp8" or "dense" (as the other weights)

    @classmethod
    def of(cls, raw: dict[str, Any], where: Path, default: StoredFormat | None = None) -> StoredFormat:
        """`default`: the format without a quantization_config (None: every weight dense)."""
        quant = raw.get("quantization_config")
        if quant is None:
            return default or cls(None, 4, "dense")
        if quant.get("quant_method") != "fp8":
            raise ConfigError(f"{where}: quantization_config.quant_method {quant.get('quant_method')!r} is not 'fp8'")
        block = tuple(quant.get("weight_block_size") or (128, 128))
        expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype", "fp8"))
        if len(block) != 2 or expert_dtype not in ("fp4", "fp8"):
            raise ConfigError(f"{where}: quantization_config: weight_block_size {list(block)} / expert_dtype"
                              f" {expert_dtype!r} (expected two block sides and fp4 or fp8)")
        return cls((int(block[0]), int(block[1])), 1 if quant.get("scale_fmt") == "ue8m0" else 4, expert_dtype)


RELEASED = StoredFormat((FP8_BLOCK, FP8_BLOCK), 1, "fp4")  # the release's defaults (V4-Flash's)


@dataclass(frozen=True)
class WeightTensor:
    name: str
    kind: str
    nbytes: int
    sharded: bool

    def per_rank(self, ranks: int) -> int:
        return -(-self.nbytes // ranks) if self.sharded else self.nbytes


def kind_of(name: str) -> str:
    return next(kind for kind, fragments in KINDS if any(f in name for f in fragments))


def meta_model(config: ModelConfig, mtp: bool = False) -> torch.nn.Module:
    """The serving model with every tensor on the meta device: shapes and dtypes, no storage; with
    `mtp`, its MTP draft layers too (as load_model(mtp=True) attaches them)."""
    with torch.device("meta"):
        model = DeepseekV41(config) if config.is_v41 else DeepseekV4(config)
        if mtp:
            attach_mtp(model)
    return model


def meta_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers, each once (a tied head is the embedding, as the loader makes it)."""
    tied = model.config.tie_word_embeddings
    return [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if not (tied and n == "lm_head.weight")]


def stored_bytes(name: str, tensor: torch.Tensor, fmt: StoredFormat, dtype: torch.dtype) -> int:
    """Bytes of one parameter as the checkpoint stores it."""
    if fmt.experts == "fp4" and ".mlp.experts." in name:
        return tensor.numel() // 2 + tensor.numel() // MX_BLOCK
    if fmt.fp8_block and (".mlp.experts." in name or stored_fp8(name)) and tensor.dim() >= 2:
        rows, cols = tensor.shape[-2:]
        blocks = -(-rows // fmt.fp8_block[0]) * -(-cols // fmt.fp8_block[1])
        return tensor.numel() + tensor.numel() // (rows * cols) * blocks * fmt.scale_bytes
    return tensor.numel() * loaded_dtype(name, dtype, tensor.dtype).itemsize


def weight_tensors(config_json: Path, quantization: str, dtype: torch.dtype,
                   load_format: str = "auto", mtp: bool = False) -> tuple[ModelConfig, list[WeightTensor]]:
    """Every weight of the model that `config_json` describes (`mtp`: its MTP layers too), with its
    bytes in the held format."""
    model_config = ModelConfig.from_file(config_json)
    fmt = None
    if quantization == "checkpoint":
        default = RELEASED if load_format == "dummy" else None
        fmt = StoredFormat.of(json.loads(config_json.read_text()), config_json, default)
    out = []
    for name, tensor in meta_tensors(meta_model(model_config, mtp)):
        if fmt is None:
            nbytes = tensor.numel() * loaded_dtype(name, dtype, tensor.dtype).itemsize
        else:
            nbytes = stored_bytes(name, tensor, fmt, dtype)
        out.append(WeightTensor(name, kind_of(name), nbytes, any(f in name for f in SHARDED)))
    return model_config, out


def draft_tensors(draft: DSparkConfig, draft_json: Path, quantization: str, dtype: torch.dtype) -> list[WeightTensor]:
    """The DSpark draft's weights, named as the engine's model holds them (`dspark.mtp.*`), with their
    bytes as load_dspark holds them: dense in the loader's dtypes, or with `checkpoint` in the formats
    the draft's config.json names (its quantization_config: FP8 block side, MXFP4 experts; none: dense)."""
    fp8, packed = None, False
    if quantization == "checkpoint":
        fp8, packed = draft_formats(draft_json)
    held = held_draft(draft, fp8, packed)
    return [WeightTensor(f"dspark.{name}", kind_of("dspark."), nbytes, any(f in name for f in SHARDED))
            for name, nbytes in held_tensor_bytes(held, dtype)]


def draft_formats(config_json: Path) -> tuple[int | None, bool]:
    """(FP8 block side or None, MXFP4 experts) of a draft checkpoint, from its config.json's
    quantization_config (at the top or in V4.1's text_config); without one every weight is dense."""
    raw = json.loads(config_json.read_text())
    if (raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")) is None:
        return None, False
    released = ReleasedFormat.of(config_json)
    return released.fp8_block, released.packed_experts
