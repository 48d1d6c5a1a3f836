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
class LayerCache:
    window: torch.Tensor  # [slots, sliding_window, head_dim], position p at row p % sliding_window
    compressor: PoolerCache | None
    indexer: PoolerCache | None


@dataclass
class ModelCache:
    layers: list[LayerCache]
    num_slots: int
    max_len: int

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

        layers = []
        for layer, kind in enumerate(config.layer_types):
            rate = config.compress_rates[layer]
            window = torch.zeros(num_slots, config.sliding_window, config.head_dim, dtype=dtype, device=device)
            compressor = pooler(rate, kind == CSA, config.head_dim) if rate else None
            indexer = pooler(rate, True, config.index_head_dim) if kind == CSA else None
            layers.append(LayerCache(window=window, compressor=compressor, indexer=indexer))
        return cls(layers=layers, num_slots=num_slots, max_len=max_len)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            tensors = [layer.window]
            for pooler in (layer.compressor, layer.indexer):
                if pooler is not None:
                    tensors += [pooler.raw_kv, pooler.raw_gate, pooler.entries]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total
