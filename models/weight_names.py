"""Checkpoint tensor names -> this model's parameter names.

Three spellings reach the loader: transformers' module names (`model.layers.0.self_attn.q_a_proj`),
the original release's (`layers.0.attn.wq_a`, per-expert `ffn.experts.3.w1`), and what
transformers' `save_pretrained` writes, which is the release spelling under a `model.` prefix.
The MTP layers (`mtp.N.*`) map onto models/mtp.py's MTPLayer `mtp.N`: its own tensors keep their names
(`hc_head_fn` becomes `hc_head.hc_fn`, as the model's does), its decoder layer's are renamed as a layer's
are, under `mtp.N.block.`. All are mapped onto the module names; per-expert matrices are stacked into the
fused `experts.gate_up_proj` ([E, 2I, D], w1 rows then w3 rows) and `experts.down_proj` ([E, D, I]).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_TOP_LEVEL = [
    (re.compile(r"^embed\.weight$"), "embed_tokens.weight"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
]
_LAYER_RENAMES = [
    (re.compile(r"\.attn\."), ".self_attn."),
    (re.compile(r"\.ffn\."), ".mlp."),
    (re.compile(r"\.self_attn\.indexer\.compressor\."), ".self_attn.compressor.indexer."),
    (re.compile(r"\.self_attn\.indexer\.weights_proj\."), ".self_attn.compressor.indexer.scorer.weights_proj."),
    (re.compile(r"\.self_attn\.indexer\.wq_b\."), ".self_attn.compressor.indexer.q_b_proj."),
    (re.compile(r"\.attn_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".\1_hc.\2"),
    (re.compile(r"\.attn_sink$"), ".sinks"),
    (re.compile(r"\.(self_attn|compressor|indexer)\.norm\."), r".\1.kv_norm."),
    (re.compile(r"\.ape$"), ".position_bias"),
    (re.compile(r"\.wq_a\."), ".q_a_proj."),
    (re.compile(r"\.wq_b\."), ".q_b_proj."),
    (re.compile(r"\.wkv\."), ".kv_proj."),
    (re.compile(r"\.wgate\."), ".gate_proj."),
    (re.compile(r"\.wo_a\."), ".o_a_proj."),
    (re.compile(r"\.wo_b\."), ".o_b_proj."),
    (re.compile(r"\.q_norm\."), ".q_a_norm."),
    (re.compile(r"\.gate\.bias$"), ".gate.e_score_correction_bias"),
    (re.compile(r"\.shared_experts\.w1\."), ".shared_experts.gate_proj."),
    (re.compile(r"\.shared_experts\.w2\."), ".shared_experts.down_proj."),
    (re.compile(r"\.shared_experts\.w3\."), ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^((?:model\.layers|mtp)\.\d+\.(?:block\.)?mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_MTP_OWN = ("enorm.", "hnorm.", "norm.", "e_proj.", "h_proj.", "hc_head.", "block.")  # the rest: its decoder layer's


def module_name(stored: str) -> str:
    name = stored[len("model."):] if stored.startswith("model.") else stored
    if name in ("head.weight", "lm_head.weight"):
        return "lm_head.weight"
    if _MTP.match(name):
        return _mtp_module_name(name)
    for pattern, replacement in _TOP_LEVEL:
        name = pattern.sub(replacement, name)
    if name.startswith("layers."):
        for pattern, replacement in _LAYER_RENAMES:
            name = pattern.sub(replacement, name)
    return "model." + name


def _mtp_module_name(name: str) -> str:
    index, rest = _MTP.match(name).groups()
    rest = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", rest)
    if rest.startswith(_MTP_OWN):
        return f"mtp.{index}.{rest}"
    name = f"mtp.{index}.block.{rest}"
    for pattern, replacement in _LAYER_RENAMES:
        name = pattern.sub(replacement, name)
    return name


@dataclass
class ExpertParts:
    """Stored names of one layer's per-expert matrices: {expert: {"w1": name, "w2": ..., "w3": ...}}."""

    by_expert: dict[int, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))


@dataclass
class NameIndex:
    direct: dict[str, str]  # module name -> stored name
    experts: dict[str, ExpertParts]  # "model.layers.N.mlp.experts" -> per-expert parts

    @classmethod
    def build(cls, stored_names: set[str], module_names: bool = False) -> "NameIndex":
        """`module_names`: the checkpoint already uses this model's module names (V4.1, whose names are
        HF's; the V4 release renames would misread some of them, e.g. `engram.wkv`)."""
        direct: dict[str, str] = {}
        experts: dict[str, ExpertParts] = defaultdict(ExpertParts)
        for stored in sorted(stored_names):
            name = stored if module_names else module_name(stored)
            match = _EXPERT.match(name)
            if match:
                experts[match.group(1)].by_expert[int(match.group(2))][match.group(3)] = stored
            else:
                direct.setdefault(name, stored)
        return cls(direct=direct, experts=dict(experts))
