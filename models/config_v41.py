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

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
SHARED_COMPRESSED = "shared_compressed_attention"
SLIDING = "sliding_attention"

_RELEASE_RATIOS = [0, 0] + [2] * 18 + [1] * 20
_RELEASE_KV_SOURCES = [2, 8, 14, 20]
_RELEASE_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]


@dataclass(frozen=True)
class EngramSpec:
    """Engram hashed n-gram memory: which layers, table layout inputs and the row format."""

    layer_ids: tuple[int, ...]
    prime_search_start: int  # `engram_vocab_size`: table sizes are the primes above it
    num_embeddings: tuple[int, ...]  # rows per layer table (sum of that layer's primes)
    max_ngram: int
    n_heads: int
    head_dim: int
    pad_id: int  # raw token id whose compressed id fills blocked look-back slots
    compressed_vocab_size: int | None

    @property
    def n_columns(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def context_len(self) -> int:
        return self.max_ngram - 1


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
        from models.config import ConfigError

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
    from models.config import ConfigError

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
    from models.config import ConfigError

    layer_ids = tuple(int(i) for i in (d.get("engram_layer_ids") or ()))
    if not layer_ids:
        return None
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise ConfigError(f"engram_layer_ids {list(layer_ids)}: ids must be distinct layers below {n_layers}")
    sizes = d.get("engram_num_embeddings")
    sizes = tuple(int(s) for s in sizes) if sizes is not None else (0,) * len(layer_ids)
    if len(sizes) != len(layer_ids):
        raise ConfigError("engram_num_embeddings must have one entry per engram_layer_ids entry")
    spec = EngramSpec(
        layer_ids=layer_ids,
        prime_search_start=int(d.get("engram_vocab_size", 16_000_000)),
        num_embeddings=sizes,
        max_ngram=int(d.get("engram_max_ngram_size", 4)),
        n_heads=int(d.get("engram_n_heads", 8)),
        head_dim=int(d.get("engram_head_dim", 256)),
        pad_id=int(d.get("engram_pad_id", 2)),
        compressed_vocab_size=d.get("engram_compressed_vocab_size"),
    )
    if spec.max_ngram < 2 or spec.n_heads < 1:
        raise ConfigError("engram_max_ngram_size must be >= 2 and engram_n_heads >= 1")
    if spec.head_dim % 32:
        raise ConfigError(f"engram_head_dim {spec.head_dim} must be a multiple of 32 (one scale per 32 channels)")
    return spec
