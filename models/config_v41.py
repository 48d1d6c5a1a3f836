"""DeepSeek-V4.1 text config: the keys that differ from V4, resolved into ModelConfig.

V4.1 compresses with "CSA2": per-layer compress ratios 0 (window only), 2 (two tokens pooled per
entry) or 1 (one entry per token). Only *kv source* layers own a compressor; the compressed store is
shared with the following layers up to the next source. *Index source* layers own a lightning indexer
and publish top-k entry ids that later layers reuse; the *candidate source*'s block choice narrows
every later index source (a two-level top-k). Engram layers add hashed n-gram memory. There are no
hash-routed MoE layers. Defaults follow the reference configuration (HF `DeepseekV41TextConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engram_store.spec import EngramSpec, EngramSpecError
from engram_store.spec import engram_spec as read_engram_spec
from models.config_error import ConfigError

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
SHARED_COMPRESSED = "shared_compressed_attention"
SLIDING = "sliding_attention"

_RELEASE_RATIOS = [0, 0] + [2] * 18 + [1] * 20
_RELEASE_KV_SOURCES = [2, 8, 14, 20]
_RELEASE_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]


@dataclass(frozen=True)
class SharedCompression:
    """Which layers own the compressor and the indexer, and the two-level top-k settings."""

    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int | None
    candidate_block_size: int
    candidate_topk_blocks: int

    def kv_source_for(self, layer: int) -> int | None:
        """The most recent kv source at or before `layer` (whose store the layer attends)."""
        earlier = [s for s in self.kv_sources if s <= layer]
        return earlier[-1] if earlier else None


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The flat text config of a composite `deepseek_v41` config (top-level token ids fill gaps)."""
    if raw.get("model_type") != "deepseek_v41":
        return dict(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):

        raise ConfigError("model_type 'deepseek_v41' needs a 'text_config' object")
    merged = dict(text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "vocab_size"):
        if key not in merged and key in raw:
            merged[key] = raw[key]
    merged["model_type"] = "deepseek_v41"
    return merged


def compress_ratios(d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    ratios = d.get("compress_ratios")
    if ratios is None:
        n_ratio2 = -(-max(n_layers - 2, 0) // 2)
        ratios = ([0, 0] + [2] * n_ratio2 + [1] * n_layers)[:n_layers]
    return tuple(int(r) for r in list(ratios)[:n_layers])


def shared_compression(d: dict[str, Any], ratios: tuple[int, ...]) -> SharedCompression:

    kv = d.get("kv_source_layer_ids")
    if kv is None:
        if list(ratios) == _RELEASE_RATIOS:
            kv = _RELEASE_KV_SOURCES
        else:
            kv = [i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r)]
    index = d.get("index_source_layer_ids")
    if index is None:
        index = _RELEASE_INDEX_SOURCES if list(kv) == _RELEASE_KV_SOURCES else list(kv)
    candidate = d["candidate_source_layer_id"] if "candidate_source_layer_id" in d else (kv[-1] if kv else None)
    if candidate is not None and candidate < 0:
        candidate = None
    spec = SharedCompression(
        kv_sources=tuple(sorted(int(i) for i in kv)),
        index_sources=tuple(sorted(int(i) for i in index)),
        candidate_source=None if candidate is None else int(candidate),
        candidate_block_size=int(d.get("candidate_block_size", 8)),
        candidate_topk_blocks=int(d.get("candidate_topk_blocks", 2048)),
    )
    n = len(ratios)
    for key, layers in (("kv_source_layer_ids", spec.kv_sources), ("index_source_layer_ids", spec.index_sources)):
        bad = [i for i in layers if not 0 <= i < n or ratios[i] <= 0]
        if bad:
            raise ConfigError(f"{key} {bad}: every source must be a layer with compress_ratios > 0")
    orphans = [i for i in range(n) if (ratios[i] > 0 or i in spec.index_sources) and spec.kv_source_for(i) is None]
    if orphans:
        raise ConfigError(f"layers {orphans} compress but no kv_source_layer_ids entry is at or before them")
    if spec.candidate_source is not None and spec.candidate_source not in spec.index_sources:
        raise ConfigError(f"candidate_source_layer_id {spec.candidate_source} is not an index source")
    if spec.candidate_block_size < 1 or spec.candidate_topk_blocks < 1:
        raise ConfigError("candidate_block_size and candidate_topk_blocks must be >= 1")
    return spec


def engram_spec(d: dict[str, Any], n_layers: int) -> EngramSpec | None:
    """engram_store/spec.py reads the Engram keys (the converter reads them too); its errors are config errors."""

    try:
        return read_engram_spec(d, n_layers)
    except EngramSpecError as exc:
        raise ConfigError(str(exc)) from exc
