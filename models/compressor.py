"""Window poolers of the compressed attention branches (CSA and HCA) and the lightning indexer.

A pooler projects every token to (kv, gate), and each time a window of `rate` tokens closes it emits
one entry: the softmax(gate + position_bias)-weighted sum of the window's kv, RMS-normed, with RoPE
at the window's first position. The overlapping form (CSA and its indexer) projects twice the width:
entry w pools the first half ("Ca") of window w-1 together with the second half ("Cb") of window w,
so entry 0 has only Cb. Entry w becomes visible to a query at position t once t >= w*rate + rate - 1.

Decode never recomputes the prefix: raw projections of windows that are not closed yet (and, for
the overlap, the previous window) live in a per-slot ring, and entries are appended to the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import stable_topk
from kernels.batch_invariant import batch_invariant_active
from kernels.index_topk import indexer_topk, topk_per_query
from kernels.indexer import indexer_scores
from kernels.pooler import combine_windows, pool_decode_applies, pool_decode_reference, pool_decode_triton
from models.batch import DecodeBatch, ForwardBatch, SequenceChunk
from models.cache import PoolerCache, paged_read, paged_write, paged_write_rows
from models.layers import RMSNorm, RotaryTable, apply_rope, apply_rope_


class WindowPooler(nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def update(self, x: torch.Tensor, batch: ForwardBatch, cache: PoolerCache, rope: RotaryTable) -> None:
        """Adds the chunk tokens' projections to each slot and appends the entries of closed windows."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        for chunk in batch.chunks:
            self._update_chunk(chunk, kv[chunk.rows], gate[chunk.rows], cache, rope)

    def _update_chunk(
        self, chunk: SequenceChunk, kv: torch.Tensor, gate: torch.Tensor, cache: PoolerCache, rope: RotaryTable
    ) -> None:
        rate, p0, p1 = self.rate, chunk.position, chunk.end_position
        first_window, end_window = p0 // rate, p1 // rate  # windows [first, end) close in this chunk
        history_start = max(0, (first_window - (1 if self.overlap else 0)) * rate)
        kept = torch.arange(history_start, p0, device=kv.device) % cache.ring
        all_kv = torch.cat([cache.raw_kv[chunk.slot, kept], kv])  # positions [history_start, p1)
        all_gate = torch.cat([cache.raw_gate[chunk.slot, kept], gate])
        new_rows = torch.arange(max(p0, p1 - cache.ring), p1, device=kv.device)
        cache.raw_kv[chunk.slot, new_rows % cache.ring] = kv[new_rows - p0]
        cache.raw_gate[chunk.slot, new_rows % cache.ring] = gate[new_rows - p0]
        if end_window > first_window:
            entries = self._pool(all_kv, all_gate, history_start, first_window, end_window)
            positions = torch.arange(first_window, end_window, device=kv.device) * rate
            cos, sin = rope(positions)
            paged_write(cache.entries, chunk.pages, first_window, apply_rope(entries, cos, sin))

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, offset: int, first: int, end: int) -> torch.Tensor:
        rate = self.rate
        windows = torch.arange(first, end, device=kv.device)
        rows = windows[:, None] * rate + torch.arange(rate, device=kv.device)[None, :] - offset  # [n, rate]
        prev_rows = (rows - rate).clamp(min=0)
        return self._combine(kv[rows], gate[rows], kv[prev_rows], gate[prev_rows], windows == 0)

    def _combine(
        self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor, prev_gate: torch.Tensor, no_prev: torch.Tensor
    ) -> torch.Tensor:
        """Entries [n, head_dim] from the raw projections [n, rate, width] of each window's tokens and
        (overlap only) of the window before it; `no_prev` [n] marks window 0, which has none."""
        pooled = combine_windows(kv, gate, prev_kv, prev_gate, no_prev, self.position_bias, self.head_dim, self.overlap)
        return self.kv_norm(pooled)

    def decode_update(self, x: torch.Tensor, batch: DecodeBatch, cache: PoolerCache, rope: RotaryTable) -> None:
        """One token per sequence, without host reads: the token joins its slot's ring; the entry of
        its window is pooled from the ring every step and written only where the token closes it
        (elsewhere the page keeps what it held). On the GPU one kernel does it all (kernels/pooler.py)."""
        rate, positions = self.rate, batch.positions
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        cos, sin = rope(positions, rate)
        args = (cache.raw_kv, cache.raw_gate, batch.slots, positions, kv, gate, self.position_bias,
                self.kv_norm.weight, self.kv_norm.eps, cos, sin, rate, self.overlap)
        if pool_decode_applies(cache.raw_kv, self.overlap, cos.shape[-1]):
            plain = isinstance(cache.entries, torch.Tensor) and cache.entries.dtype == cache.raw_kv.dtype
            entry = pool_decode_triton(*args, store=cache.entries if plain else None, tables=batch.block_tables)
            if plain:
                return
        else:
            entry = pool_decode_reference(*args)
        closes = (positions + 1) % rate == 0
        paged_write_rows(cache.entries, batch.block_tables, positions // rate, entry, where=closes)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class Indexer(WindowPooler):
    """Lightning indexer: its own overlapping pooler at index_head_dim, and per query
    score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]); the top `index_topk` causal entries win."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rate: int, eps: float):
        super().__init__(hidden_size, head_dim, rate, overlap=True, eps=eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, n_heads)

    def select(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        chunk: SequenceChunk,
        cache: PoolerCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """[n, k] ids of the entries each query of the chunk attends to (top `index_topk` by score among
        those complete at its position; -1 where fewer are), None before the first entry closes."""
        n_entries = chunk.end_position // self.rate
        if n_entries == 0:
            return None
        positions = torch.arange(chunk.position, chunk.end_position, device=x.device)
        counts = (positions + 1) // self.rate  # entries complete at each query's position
        q = self.q_b_proj(q_residual).view(chunk.length, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin)  # the model's dtype: kernels/index_topk.py scores it with exact products
        keys = paged_read(cache.entries, chunk.pages, n_entries)
        weights = self.scorer.weights_proj(x).float() * self.n_heads**-0.5
        # in tiles (kernels/index_topk.py): no [queries, heads, entries] tensor; deterministic mode a query at a time
        pick = topk_per_query if batch_invariant_active() else indexer_topk
        return pick(q, weights, keys, counts, self.topk).ids

    def decode_select(
        self, x: torch.Tensor, q_residual: torch.Tensor, batch: DecodeBatch, cache: PoolerCache,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> torch.Tensor:
        """One query per sequence, scored against every entry its block table can hold (the table's
        width fixes the shapes); returns the top-k entry ids by score [B, k] (those at or past the
        visible entries, (position + 1) // rate, are not attended)."""
        n_heads, dim = self.n_heads, self.head_dim
        q = apply_rope_(self.q_b_proj(q_residual).view(-1, n_heads, dim), cos, sin)  # in place: a fresh output
        visible = (batch.positions + 1) // self.rate
        total = indexer_scores(q, self.scorer.weights_proj(x), cache.entries, batch.block_tables, visible,
                               weight_scale=n_heads**-0.5)
        _, ids = stable_topk(total, min(self.topk, total.shape[1]))
        return ids


class CompressedSparseCompressor(WindowPooler):
    """CSA: overlapping pooler at head_dim plus the indexer that picks which entries each query sees."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, eps: float, indexer: Indexer):
        super().__init__(hidden_size, head_dim, rate, overlap=True, eps=eps)
        self.indexer = indexer


class HeavilyCompressedCompressor(WindowPooler):
    """HCA: non-overlapping pooler; every closed window is visible, no indexer."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, eps: float):
        super().__init__(hidden_size, head_dim, rate, overlap=False, eps=eps)
