"""Which weights the release stores quantized, and how: one list for the counts and the draws.

The published V4 / V4.1 safetensors keep the routed experts MXFP4 (E2M1 pairs, a ue8m0 scale per 32)
or FP8, and the attention projections, the shared expert, Engram's wkv and the MTP layer's e_proj and
h_proj FP8 e4m3 with one scale per `weight_block_size` square block; everything else in its serving
dtype (float32 where the loader keeps float32). `python -m server plan` counts a checkpoint's bytes by
this list (engine/plan_weights.py), and dummy weights in the released format are drawn by it
(models/random_model.py), so both describe the same model as a real checkpoint loaded with
`model.quantization: checkpoint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kernels.quant import FP8_BLOCK
from models.loader import fp8_block  # the loader's reading of weight_block_size (and its checks)

ATTENTION_PROJECTIONS = tuple(f".self_attn.{p}_proj.weight" for p in ("q_a", "q_b", "kv", "o_a", "o_b"))
STORED_FP8 = ATTENTION_PROJECTIONS + (".mlp.shared_experts.", ".engram.wkv.weight", ".e_proj.weight",
                                      ".h_proj.weight")
ROUTED_EXPERTS = ".mlp.experts."


def stored_fp8(name: str) -> bool:
    """Whether the release stores parameter `name` (a 2-D weight) as block-scaled FP8."""
    return any(fragment in name for fragment in STORED_FP8)


@dataclass(frozen=True)
class ReleasedFormat:
    """The release's formats for one config.json: FP8 in `fp8_block` square blocks, routed experts MXFP4
    when `packed_experts` (FP8 otherwise, which serving dequantizes)."""

    fp8_block: int = FP8_BLOCK
    packed_experts: bool = True

    @classmethod
    def of(cls, config_json: Path) -> ReleasedFormat:
        """config.json's quantization_config (at the top or in V4.1's text_config): weight_block_size and
        expert_dtype (also read at the top, as V4-Flash spells it; fp8 when a quantization_config names
        none, as plan_weights reads it). Without one: the release's defaults, 128 x 128 FP8 blocks and
        MXFP4 experts (what `bench.slice --weights released` holds)."""
        raw = json.loads(config_json.read_text())
        quant = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
        if quant is None:
            return cls()
        expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype", "fp8"))
        return cls(fp8_block(config_json), expert_dtype == "fp4")
