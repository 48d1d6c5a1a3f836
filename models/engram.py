"""Engram fusion (DeepSeek-V4.1): gathered n-gram rows gated into every mHC stream.

The rows of all columns are concatenated and one projection `wkv` gives a key per stream plus one
shared value. Per stream: dot = sum(h * q_w * k_w * key) / (rms(h) * rms(key) * sqrt(D)),
gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) (a zero dot gives +1e-3), and out = h + gate * value. Dead positions
(padding, image spans) keep h unchanged. Everything runs in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from engram_store.rows import RowSource
from models.batch import ForwardBatch
from models.engram_hash import NgramHasher

GATE_FLOOR = 1e-6


class EngramFusion(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, n_columns: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.hc, self.eps = hidden_size, hc_mult, eps
        self.wkv = nn.Linear(n_columns * head_dim, (hc_mult + 1) * hidden_size, bias=False, dtype=torch.float32)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))

    def gate_terms(self, streams: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D], rows [T, cols, head_dim] -> (kv [T, (hc+1)D], dot [T, hc], value [T, D])."""
        h = streams.float()
        kv = self.wkv(rows.flatten(1).float())
        key = kv[:, : self.hc * self.hidden].view(-1, self.hc, self.hidden)
        value = kv[:, self.hc * self.hidden :]
        dot = (h * self.q_weight * self.k_weight * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        return kv, dot * self.hidden**-0.5, value

    @staticmethod
    def gate(dot: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
        return gate if live is None else gate * live[:, None].to(gate.dtype)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        _, dot, value = self.gate_terms(streams, rows)
        gate = self.gate(dot, live)
        return (streams.float() + gate[..., None] * value[:, None, :]).to(streams.dtype)


class EngramMemory:
    """Everything an Engram forward needs besides the fusion weights: the n-gram hasher (from the
    checkpoint's tokenizer) and the row source (in memory here; engram_store/ streams from disk).

    Row ids depend only on tokens, so one call hashes the whole step for every Engram layer; each slot's
    look-back (the last max_ngram - 1 compressed ids) is carried in the cache between steps."""

    def __init__(self, hasher: NgramHasher, rows: RowSource) -> None:
        self.hasher, self.source = hasher, rows

    def row_ids(self, batch: ForwardBatch, context: torch.Tensor) -> torch.Tensor:
        """[T, engram layers, columns] int64 row ids of the step's tokens; advances `context` [slots, N-1]."""
        per_chunk = []
        tokens = batch.token_ids.tolist()
        for chunk in batch.chunks:
            carried = self.hasher.empty_context() if chunk.position == 0 else context[chunk.slot].tolist()
            ids, carried = self.hasher.row_ids(tokens[chunk.rows], None, carried)
            context[chunk.slot] = torch.tensor(carried, dtype=context.dtype, device=context.device)
            per_chunk.append(torch.from_numpy(ids))
        row_ids = torch.cat(per_chunk)
        self.source.prefetch(row_ids)  # disk tiers start reading while the layers before Engram run
        return row_ids

    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        """[T, columns, head_dim] float32 rows of the `layer_index`-th Engram layer."""
        return self.source.rows(layer_index, row_ids[:, layer_index])

    def failed_tokens(self) -> dict[int, str]:
        """Batch rows of the last step that got no valid Engram rows (their requests must fail)."""
        return self.source.failed_tokens()
