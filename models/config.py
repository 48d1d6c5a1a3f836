"""DeepSeek-V4 model configuration, read from a checkpoint's config.json.

Accepts both spellings that exist in the wild: Hugging Face transformers' keys (`layer_types`,
`compress_rates`, `mlp_layer_types`, nested `rope_parameters`) and the original release's
(`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`). Everything the model
needs is resolved here once, into one frozen dataclass; the model never reads raw dicts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.config_error import ConfigError
from models.config_v41 import (
    SHARED_COMPRESSED,
    V41_MODEL_TYPES,
    EngramSpec,
    SharedCompression,
    compress_ratios,
    engram_spec,
    shared_compression,
    text_config,
)

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"

_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one kind (`main` for sliding layers, `compress` for CSA / HCA)."""

    theta: float
    dim: int
    yarn_factor: float | None = None
    yarn_original_max_positions: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attention_factor: float = 1.0

    def inv_freq(self) -> "torch.Tensor":  # noqa: F821 - torch imported lazily for pure-config users
        """One frequency per interleaved channel pair; YaRN blends interpolated and extrapolated ones."""
        import torch

        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device="cpu") / self.dim
        pos_freqs = self.theta**exponents
        extrapolation = 1.0 / pos_freqs
        if self.yarn_factor is None:
            return extrapolation
        interpolation = 1.0 / (self.yarn_factor * pos_freqs)
        low, high = self._yarn_correction_range()
        if low == high:
            high += 0.001
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        keep_extrapolated = 1 - ramp
        return interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated

    def _yarn_correction_range(self) -> tuple[float, float]:
        original = self.yarn_original_max_positions

        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low = math.floor(correction_dim(self.yarn_beta_fast))
        high = math.ceil(correction_dim(self.yarn_beta_slow))
        return max(low, 0), min(high, self.dim - 1)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[int, ...]  # per layer; 0 for sliding-only layers
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeSpec
    compress_rope: RopeSpec
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    # DeepSeek-V4.1 only (None / defaults for V4):
    shared_compression: SharedCompression | None = None
    engram: EngramSpec | None = None
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # V4.1's quantization-aware formats; off only to compare with a reference run without them.
    simulate_quantization: bool = True
    # V4's MTP (next-token prediction) layers after the last layer, by attention kind (the release lists
    # each one's ratio after the layers' in compress_ratios: 0, sliding only); empty without them.
    mtp_layer_types: tuple[str, ...] = ()
    mtp_compress_rates: tuple[int, ...] = ()

    @property
    def is_v41(self) -> bool:
        return self.model_type in V41_MODEL_TYPES

    @property
    def max_compress_rate(self) -> int:
        return max(self.compress_rates)

    def is_compressed(self, layer: int) -> bool:
        return self.compress_rates[layer] > 0

    @property
    def num_nextn_predict_layers(self) -> int:
        return len(self.mtp_layer_types)

    def mtp_layers_config(self) -> "ModelConfig":
        """The MTP layers alone, as the layers of a model (layer i = MTP layer i, each a routed MoE, never
        hash-routed: DeepSeek's MTP blocks continue the layer ids past the hash layers), so the layer
        classes and ModelCache.allocate build them and their state by index."""
        n = self.num_nextn_predict_layers
        alone = replace(self, num_layers=n, layer_types=self.mtp_layer_types, compress_rates=self.mtp_compress_rates,
                        mlp_layer_types=(MOE,) * n, mtp_layer_types=(), mtp_compress_rates=())
        if self.is_v41:  # window attention only: no kv or index source, no Engram
            alone = replace(alone, engram=None, shared_compression=replace(
                self.shared_compression, kv_sources=(), index_sources=(), candidate_source=None))
        return alone

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read model config: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type in V41_MODEL_TYPES:
            return cls._from_v41_dict(text_config(raw))
        if model_type != "deepseek_v4":
            raise ConfigError(
                f"model_type {model_type!r} is not supported (expected 'deepseek_v4', 'deepseek_v41' or 'deepseek_v41_text')"
            )
        d = dict(raw)
        n_layers = _require(d, "num_hidden_layers")
        n_mtp = d.get("num_nextn_predict_layers") or 0
        if not isinstance(n_mtp, int) or n_mtp < 0:
            raise ConfigError(f"num_nextn_predict_layers {n_mtp!r} must be a count of layers (>= 0)")
        all_types = _layer_types(d, n_layers, n_mtp)
        layer_types, mtp_types = all_types[:n_layers], all_types[n_layers:]
        rates_by_type = dict(_DEFAULT_COMPRESS_RATES)
        rates_by_type.update(d.get("compress_rates") or {})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if d.get(legacy) is not None:
                rates_by_type[kind] = d[legacy]

        def rates(types: tuple[str, ...]) -> tuple[int, ...]:
            return tuple(0 if t == SLIDING else int(rates_by_type[t]) for t in types)

        return cls(
            **_common_fields(d, index_n_heads=64, rms_norm_eps=1e-6),
            model_type=model_type,
            num_layers=n_layers,
            layer_types=layer_types,
            compress_rates=rates(layer_types),
            mlp_layer_types=_mlp_layer_types(d, n_layers),
            mtp_layer_types=mtp_types,
            mtp_compress_rates=rates(mtp_types),
        )._validated()

    @classmethod
    def _from_v41_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """V4.1: layer kinds follow from the compress ratios and the kv sources; every MoE is top-k routed."""
        n_layers = _require(d, "num_hidden_layers")
        ratios = compress_ratios(d, n_layers)
        if len(ratios) != n_layers or any(r < 0 for r in ratios):
            raise ConfigError(f"compress_ratios must give {n_layers} non-negative entries, got {list(ratios)}")
        shared = shared_compression(d, ratios)
        layer_types = tuple(SHARED_COMPRESSED if i in shared.kv_sources else SLIDING for i in range(n_layers))
        n_mtp = d.get("num_nextn_predict_layers") or 0
        if not isinstance(n_mtp, int) or n_mtp < 0:
            raise ConfigError(f"num_nextn_predict_layers {n_mtp!r} must be a count of layers (>= 0)")
        return cls(
            **_common_fields(d, index_n_heads=32, rms_norm_eps=1e-20),
            model_type=d["model_type"],
            num_layers=n_layers,
            layer_types=layer_types,
            compress_rates=ratios,
            mlp_layer_types=(MOE,) * n_layers,
            shared_compression=shared,
            engram=engram_spec(d, n_layers),
            mtp_layer_types=(SLIDING,) * n_mtp,  # models/mtp_v41.py: window attention, routed MoE
            mtp_compress_rates=(0,) * n_mtp,
            gate_temp=float(d.get("gate_temp", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        )._validated()

    def _validated(self) -> "ModelConfig":
        if self.gate_temp <= 0:
            raise ConfigError(f"gate_temp {self.gate_temp} must be > 0")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not one of sqrtsoftplus, softmax, sigmoid")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ConfigError("o_groups must divide num_attention_heads * head_dim")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ConfigError(f"rope head dim {self.rope_head_dim} must be even and <= head_dim")
        has_indexer = CSA in self.layer_types or bool(self.shared_compression and self.shared_compression.index_sources)
        if self.rope_head_dim > self.index_head_dim and has_indexer:
            raise ConfigError("index_head_dim must be at least the rope head dim")
        return self


def _common_fields(d: dict[str, Any], index_n_heads: int, rms_norm_eps: float) -> dict[str, Any]:
    """Keys V4 and V4.1 share, with the family's defaults where they differ."""
    head_dim = d.get("head_dim", 512)
    rope_head_dim = _rope_head_dim(d, head_dim)
    main_rope, compress_rope = _rope_specs(d, rope_head_dim)
    eos = d.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        vocab_size=d.get("vocab_size", 129280),
        hidden_size=d.get("hidden_size", 4096),
        num_heads=d.get("num_attention_heads", 64),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=d.get("q_lora_rank", 1024),
        o_groups=d.get("o_groups", 8),
        o_lora_rank=d.get("o_lora_rank", 1024),
        n_routed_experts=d.get("n_routed_experts", 256),
        num_experts_per_tok=d.get("num_experts_per_tok", 6),
        moe_intermediate_size=d.get("moe_intermediate_size", 2048),
        n_shared_experts=d.get("n_shared_experts", 1),
        scoring_func=d.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        sliding_window=d.get("sliding_window", 128),
        index_n_heads=d.get("index_n_heads", index_n_heads),
        index_head_dim=d.get("index_head_dim", 128),
        index_topk=d.get("index_topk", 512),
        hc_mult=d.get("hc_mult", 4),
        hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        rms_norm_eps=float(d.get("rms_norm_eps", rms_norm_eps)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=d.get("max_position_embeddings", 1048576),
        bos_token_id=d.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def _require(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ConfigError(f"missing key {key!r}")
    return d[key]


def _layer_types(d: dict[str, Any], n: int, mtp: int = 0) -> tuple[str, ...]:
    """The n layers' kinds, then the `mtp` MTP layers': the entries after the n-th where the config lists
    them (the release's compress_ratios does), sliding where it does not."""
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
    elif d.get("compress_ratios") is not None:
        try:
            types = [_RATIO_TO_LAYER_TYPE[int(r)] for r in d["compress_ratios"]]
        except KeyError as exc:
            raise ConfigError(f"compress_ratios entry {exc.args[0]} is not one of 0, 4, 128") from exc
    else:  # transformers' default schedule: two HCA layers, then CSA / HCA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if len(types) < n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    types = types[:n + mtp] + [SLIDING] * max(0, n + mtp - len(types))
    bad = [t for t in types if t not in ATTENTION_LAYER_TYPES]
    if bad:
        raise ConfigError(f"layer_types entries {bad} are not among {ATTENTION_LAYER_TYPES}")
    return tuple(types)


def _mlp_layer_types(d: dict[str, Any], n: int) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])[:n]
    else:
        n_hash = d.get("num_hash_layers", 3)
        types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    bad = [t for t in types if t not in (HASH_MOE, MOE)]
    if bad or len(types) != n:
        raise ConfigError(f"mlp_layer_types must have {n} entries of 'hash_moe' / 'moe', got {types}")
    return tuple(types)


def _rope_head_dim(d: dict[str, Any], head_dim: int) -> int:
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    factor = d.get("partial_rotary_factor")
    rope = d.get("rope_parameters") or {}
    if factor is None and isinstance(rope.get("main"), dict):
        factor = rope["main"].get("partial_rotary_factor")
    return int(head_dim * (factor if factor is not None else 64 / 512))


def _rope_specs(d: dict[str, Any], dim: int) -> tuple[RopeSpec, RopeSpec]:
    """Sliding layers: plain RoPE at `rope_theta`. Compressed branches: `compress_rope_theta` with the
    configured scaling (YaRN in the releases), never multiplied by YaRN's mscale (attention_factor 1)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        main_params, compress_params = rope["main"], rope["compress"]
    else:
        scaling = {k: v for k, v in rope.items() if k not in ("main", "compress")}
        main_params = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        compress_params = {**scaling, "rope_theta": d.get("compress_rope_theta", 160000.0)}
        compress_params.setdefault("attention_factor", 1.0)
    return _rope_spec(main_params, dim, d), _rope_spec(compress_params, dim, d)


def _rope_spec(params: dict[str, Any], dim: int, d: dict[str, Any]) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeSpec(theta=theta, dim=dim)
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported (default or yarn)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn rope needs original_max_position_embeddings")
    if factor is None:
        factor = d.get("max_position_embeddings", 1048576) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # YaRN's own default; V4 configs normally pin it to 1.0
        attention_factor = _yarn_mscale(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeSpec(
        theta=theta,
        dim=dim,
        yarn_factor=float(factor),
        yarn_original_max_positions=int(original),
        yarn_beta_fast=float(params.get("beta_fast") or 32),
        yarn_beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)
