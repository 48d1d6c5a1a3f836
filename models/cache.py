"""Per-sequence model state in caller-owned buffers, indexed by cache slot.

Two kinds of state per layer (ARCHITECTURE.md, "Caches and state"):
- fixed per slot: the sliding-window ring (the last `sliding_window` K=V entries) and each
  compressor's ring of raw projections for windows that are not closed yet (two windows for the
  overlapping CSA pooler, one for HCA);
- growing with length: compressed KV entries and indexer keys, one per `compress_rate` tokens.
  They are slot-contiguous here (`max_model_len // rate` rows per slot); the block manager of the
  engine pages them.
The buffers are allocated once; a forward step only writes rows into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.config import CSA, ModelConfig


@dataclass
class PoolerCache:
    """State of one window pooler (a compressor or an indexer's key compressor) for every slot."""

    raw_kv: torch.Tensor  # [slots, ring, width] projections of tokens of still-needed windows
    raw_gate: torch.Tensor  # [slots, ring, width]
    entries: torch.Tensor  # [slots, max_entries, head_dim] pooled entries, entry w covers window w

    @property
    def ring(self) -> int:
        return self.raw_kv.shape[1]


@dataclass
class SharedStore:
    """V4.1 kv-source state for every slot: the compressed entries later layers share, their index keys,
    and the raw projections of the still-open group (ratio r > 1 pools r tokens per entry)."""

    raw_kv: torch.Tensor  # [slots, r, head_dim] float32, token p at row p % r (empty ring for r = 1)
    raw_gate: torch.Tensor  # [slots, r, head_dim] float32
    entries: torch.Tensor  # [slots, max_len // r, head_dim]; entry w = group w, stored fp4-rounded with RoPE
    index_keys: torch.Tensor | None  # [slots, max_len // r, index_head_dim] when the source owns indexer keys

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.raw_kv, self.raw_gate, self.entries, self.index_keys) if t is not None]


@dataclass
class LayerCache:
    window: torch.Tensor  # [slots, sliding_window, head_dim], position p at row p % sliding_window
    compressor: PoolerCache | None
    indexer: PoolerCache | None
    shared: SharedStore | None = None  # V4.1 kv sources only


@dataclass
class ModelCache:
    layers: list[LayerCache]
    num_slots: int
    max_len: int
    # V4.1 Engram: the last max_ngram - 1 compressed token ids per slot, oldest first, -1 = none;
    # a chunk at position 0 starts from all -1, whatever the slot held before.
    engram_context: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "ModelCache":
        def pooler(rate: int, overlap: bool, head_dim: int) -> PoolerCache:
            width = (2 if overlap else 1) * head_dim
            ring = (2 if overlap else 1) * rate
            return PoolerCache(
                raw_kv=torch.zeros(num_slots, ring, width, dtype=dtype, device=device),
                raw_gate=torch.zeros(num_slots, ring, width, dtype=dtype, device=device),
                entries=torch.zeros(num_slots, max_len // rate, head_dim, dtype=dtype, device=device),
            )

        if config.is_v41:
            return cls._allocate_v41(config, num_slots, max_len, dtype, device)
        layers = []
        for layer, kind in enumerate(config.layer_types):
            rate = config.compress_rates[layer]
            window = torch.zeros(num_slots, config.sliding_window, config.head_dim, dtype=dtype, device=device)
            compressor = pooler(rate, kind == CSA, config.head_dim) if rate else None
            indexer = pooler(rate, True, config.index_head_dim) if kind == CSA else None
            layers.append(LayerCache(window=window, compressor=compressor, indexer=indexer))
        return cls(layers=layers, num_slots=num_slots, max_len=max_len)

    @classmethod
    def _allocate_v41(
        cls, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> "ModelCache":
        """Every layer keeps a window; only kv sources keep compressed state, which later layers read."""
        shared = config.shared_compression
        layers = []
        for layer in range(config.num_layers):
            window = torch.zeros(num_slots, config.sliding_window, config.head_dim, dtype=dtype, device=device)
            store = None
            if layer in shared.kv_sources:
                rate, n_entries = config.compress_rates[layer], max_len // config.compress_rates[layer]
                ring = rate if rate > 1 else 0
                owns_keys = layer in shared.index_sources
                store = SharedStore(
                    raw_kv=torch.zeros(num_slots, ring, config.head_dim, dtype=torch.float32, device=device),
                    raw_gate=torch.zeros(num_slots, ring, config.head_dim, dtype=torch.float32, device=device),
                    entries=torch.zeros(num_slots, n_entries, config.head_dim, dtype=dtype, device=device),
                    index_keys=torch.zeros(num_slots, n_entries, config.index_head_dim, dtype=dtype, device=device)
                    if owns_keys
                    else None,
                )
            layers.append(LayerCache(window=window, compressor=None, indexer=None, shared=store))
        context = None
        if config.engram is not None:
            context = torch.full((num_slots, config.engram.context_len), -1, dtype=torch.long, device=device)
        return cls(layers=layers, num_slots=num_slots, max_len=max_len, engram_context=context)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            tensors = [layer.window]
            for pooler in (layer.compressor, layer.indexer):
                if pooler is not None:
                    tensors += [pooler.raw_kv, pooler.raw_gate, pooler.entries]
            if layer.shared is not None:
                tensors += layer.shared.tensors()
            total += sum(t.numel() * t.element_size() for t in tensors)
        if self.engram_context is not None:
            total += self.engram_context.numel() * self.engram_context.element_size()
        return total
