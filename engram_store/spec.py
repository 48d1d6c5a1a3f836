"""The Engram keys of a V4.1 config.json: which layers, the table layout's inputs and the row format.

models/config_v41.py resolves them into `ModelConfig.engram`; the table converter reads them straight
from a checkpoint (`checkpoint_spec`), so engram_store/ needs no model code. The layout (hashing.py)
is computed once per spec and shared by the hasher, the store builder, the converter and `plan`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from engram_store.hashing import EngramLayout


class EngramSpecError(ValueError):
    """An Engram key of config.json that cannot describe a table layout; names the key."""


@dataclass(frozen=True)
class EngramSpec:
    """Engram hashed n-gram memory: which layers, table layout inputs and the row format."""

    layer_ids: tuple[int, ...]
    prime_search_start: int  # `engram_vocab_size`: table sizes are the primes above it
    num_embeddings: tuple[int, ...]  # rows per layer table (sum of that layer's primes); 0: not given
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

    @cached_property
    def layout(self) -> EngramLayout:
        """The primes and column offsets of every layer's table (a prime search: computed once)."""
        return EngramLayout.build(list(self.layer_ids), self.max_ngram, self.n_heads, self.prime_search_start)


def engram_spec(d: dict[str, Any], n_layers: int) -> EngramSpec | None:
    """The spec of a flat (text) config dict of `n_layers` layers; None without Engram layers."""
    layer_ids = tuple(int(i) for i in (d.get("engram_layer_ids") or ()))
    if not layer_ids:
        return None
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad or len(set(layer_ids)) != len(layer_ids):
        raise EngramSpecError(f"engram_layer_ids {list(layer_ids)}: ids must be distinct layers below {n_layers}")
    sizes = d.get("engram_num_embeddings")
    sizes = tuple(int(s) for s in sizes) if sizes is not None else (0,) * len(layer_ids)
    if len(sizes) != len(layer_ids):
        raise EngramSpecError("engram_num_embeddings must have one entry per engram_layer_ids entry")
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
        raise EngramSpecError("engram_max_ngram_size must be >= 2 and engram_n_heads >= 1")
    if spec.head_dim % 32:
        raise EngramSpecError(f"engram_head_dim {spec.head_dim} must be a multiple of 32 (one scale per 32 channels)")
    return spec


def checkpoint_spec(model_dir: Path) -> EngramSpec | None:
    """The spec in a checkpoint's config.json (a composite `deepseek_v41` config nests it in
    `text_config`); None when the model has no Engram layers."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw) if raw.get("model_type") == "deepseek_v41" else raw
    try:
        if "num_hidden_layers" not in text:
            raise EngramSpecError("num_hidden_layers is missing")
        return engram_spec(text, int(text["num_hidden_layers"]))
    except EngramSpecError as exc:
        raise EngramSpecError(f"{model_dir / 'config.json'}: {exc}") from exc
