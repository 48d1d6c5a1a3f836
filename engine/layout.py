"""What a config makes of the engine's layout, before any weight is loaded: the device and dtype, the
longest sequence, the cache's shape (on the meta device), the prefix tiers' records and the draft
proposer's bytes. `python -m server plan` (engine/plan.py) counts these, and the engine (engine/factory.py)
builds with them, so both say the same.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from contract import PrefixTierLimits
from contract.config import ConfigFileError
from engine.memory_plan import RecordLayout, prefix_tier_limits, record_layout
from models import ConfigError, ModelCache, ModelConfig
from models.cache import stored_kv_cache_dtype
from models.dspark import DSparkConfig
from models.host_tier import HostTierSpec
from worker.dspark import dspark_proposer_bytes
from worker.proposers import mtp_proposer_bytes

if TYPE_CHECKING:
    from contract.config import ServeConfig

log = logging.getLogger("ds4serve.engine")


def resolve_device(config: "ServeConfig") -> str:
    wanted = config.runtime.device
    return "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"


def resolve_dtype(config: "ServeConfig", device: str) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32  # a rank's device is cuda:<rank>
    return getattr(torch, config.model.dtype)


def max_model_len(config: "ServeConfig", model_config: ModelConfig) -> int:
    """model.max_model_len, or the model's position limit when unset. Past that limit positions have no
    trained meaning (RoPE / YaRN run out), so a longer one is refused, as vLLM refuses it."""
    limit = model_config.max_position_embeddings
    wanted = config.model.max_model_len
    if wanted is not None and wanted > limit:
        raise ConfigFileError(
            f"model.max_model_len (--max-model-len) {wanted} is past the model's position limit {limit}"
            " (max_position_embeddings in its config.json); lower it or leave it out"
        )
    return wanted or limit


class EngineConfigError(ValueError):
    """A config the engine cannot run with; names the key."""


def check_kv_cache_dtype(config: "ServeConfig", model_config: ModelConfig) -> None:
    """fp4 is lossless for V4.1 (it rounds its cache to FP4 itself); for V4 it is an opt-in that rounds.
    The host tier keeps V4.1's packed entries only."""
    if config.offload.kv == "host_packed" and not model_config.is_v41:
        raise EngineConfigError("offload.kv host_packed keeps V4.1's packed compressed KV entries in host RAM: this"
                                f" model is {model_config.model_type}; use offload.kv none")
    if cache_dtype(config) == "fp4" and not model_config.is_v41:
        log.warning("memory.kv_cache_dtype fp4 on a V4 model rounds its compressed KV and index keys to FP4: "
                    "logits move (lossy; tests/test_packed_kv.py measures how far)")
    if cache_dtype(config) == "fp8":
        if stored_kv_cache_dtype(model_config, "fp8") == "fp4":
            log.info("memory.kv_cache_dtype fp8 on V4.1: its compressed KV entries and index keys are FP4 values"
                     " already, so they are stored as the fp4 packing (lossless, fewer bytes than fp8)")
        else:
            log.info("memory.kv_cache_dtype fp8: compressed KV entries and index keys as float8_e4m3fn with a"
                     " scale per 64 channels, the entries' RoPE channels in bf16 (lossy, as vLLM's fp8)")


def check_speculative(config: "ServeConfig", model_config: ModelConfig, model_json: Path | None = None) -> None:
    """--speculative-config against the model: mtp drafts with the checkpoint's MTP layer, which it must
    have (`check_mtp`); dspark with a DSpark checkpoint of this model (V4.1's, or V4-Flash-0731's on V4:
    models/dspark.py)."""
    speculative = config.runtime.speculative_config
    if speculative is None:
        return
    if speculative.method == "mtp":
        check_mtp(config, model_config, model_json)
    if speculative.method == "dspark":
        check_dspark(config, model_config)


def check_mtp(config: "ServeConfig", model_config: ModelConfig, model_json: Path | None = None) -> None:
    """Method mtp needs the checkpoint's own MTP layer: not a checkpoint without one (the V4.1 release has
    none, DSpark drafts it; a V4.1 checkpoint with `mtp.*` layers, as this project's default model, has:
    models/mtp_v41.py), and not V4-Flash-0731, whose `mtp.*` tensors are a DSpark draft (its config.json,
    `model_json` or the model directory's, names DSpark's keys)."""
    key = "runtime.speculative_config (--speculative-config) method mtp"
    if not model_config.num_nextn_predict_layers:
        other = "dspark (its draft checkpoint as model) or ngram" if model_config.is_v41 else "ngram"
        raise EngineConfigError(f"{key}: {config.model_dir}'s config.json has no MTP layer"
                                f" (num_nextn_predict_layers 0); use method {other}")
    if model_config.is_v41:
        return  # DSpark's V4.1 drafts come as a checkpoint of their own
    path = model_json or config.model_dir / "config.json"
    try:
        DSparkConfig.from_file(path, model_config)
    except (ConfigError, OSError):
        return  # not a DSpark draft: its mtp.* layers are V4's MTP layers
    raise EngineConfigError(f"{key}: {config.model_dir}'s mtp.* layers are a DSpark draft (V4-Flash-0731);"
                            " use method dspark with this directory as model")


def check_dspark(config: "ServeConfig", model_config: ModelConfig, draft_json: Path | None = None) -> DSparkConfig:
    """The directory `model` names holds a DSpark draft of this model (V4 or V4.1 alike), whose block has
    room for the drafts; its config (from `draft_json`, else that directory's config.json)."""
    speculative = config.runtime.speculative_config
    try:
        draft = DSparkConfig.from_file(draft_json or Path(speculative.model) / "config.json", model_config)
    except ConfigError as exc:
        raise EngineConfigError(f"runtime.speculative_config.model (--speculative-config) {speculative.model}: a"
                                f" DSpark draft of {config.model_dir} is needed: {exc}") from exc
    if speculative.num_speculative_tokens > draft.block_size:
        raise EngineConfigError(
            f"runtime.speculative_config.num_speculative_tokens (--speculative-config) {speculative.num_speculative_tokens}"
            f": the DSpark draft in {speculative.model} proposes blocks of {draft.block_size}")
    return draft


def hot_tokens(config: "ServeConfig") -> int | None:
    """The runner's `kv_hot_tokens`: None without the KV host tier (offload.kv host_packed)."""
    return config.offload.kv_hot_tokens if config.offload.kv == "host_packed" else None


def cache_dtype(config: "ServeConfig") -> str:
    """The runner's `kv_cache_dtype`: offload.kv host_packed packs the cache (as memory.kv_cache_dtype fp4)."""
    return "fp4" if config.offload.kv == "host_packed" else config.memory.kv_cache_dtype


def meta_cache(config: "ServeConfig", model_config: ModelConfig, dtype: torch.dtype, max_len: int) -> ModelCache:
    """The engine's cache layout on the meta device (no memory, one page): what `python -m server plan`
    counts and what the prefix tiers' records hold (with the rings' spare rows for drafts, as the
    runner allocates it). Raises ValueError for a kv_cache_dtype the model cannot use."""
    sched, tokens = config.scheduler, hot_tokens(config)
    return ModelCache.allocate(model_config, sched.max_num_seqs + sched.snapshot_slots, max_len, dtype=dtype,
                               device="meta", num_pages=1, block_tokens=sched.block_tokens,
                               kv_cache_dtype=cache_dtype(config),
                               host_tier=None if tokens is None else HostTierSpec(tokens, sched.max_num_seqs),
                               draft_tokens=config.runtime.draft_tokens)


def draft_state_bytes(config: "ServeConfig", model_config: ModelConfig, dtype: torch.dtype, max_len: int,
                      dspark: DSparkConfig | None = None) -> int:
    """Device bytes the draft proposer holds beside the engine's cache (the MTP layer's own cache and
    held rows; `dspark`, the draft's config: its stages' context rings; nothing for ngram or without
    --speculative-config): part of the slots' fixed state."""
    if dspark is not None:
        return dspark_proposer_bytes(dspark, config.scheduler.max_num_seqs, dtype)
    if not config.runtime.drafts_with_mtp:
        return 0
    return mtp_proposer_bytes(model_config, config.scheduler.max_num_seqs, max_len, config.runtime.draft_tokens, dtype)


def prefix_records(config: "ServeConfig", model_config: ModelConfig, dtype: torch.dtype, max_len: int) -> RecordLayout:
    """One rank's prefix-tier records, from the cache layout (the runner keeps last logits, part of a
    slot record, when it has snapshot slots)."""
    vocab = model_config.vocab_size if config.scheduler.snapshot_slots else None
    return record_layout(meta_cache(config, model_config, dtype, max_len), vocab)


def prefix_tiers(config: "ServeConfig", records: RecordLayout) -> PrefixTierLimits:
    return prefix_tier_limits(config.prefix_cache, config.parallel.tensor_parallel_size, records)
