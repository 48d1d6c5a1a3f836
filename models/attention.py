"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus, on CSA / HCA layers, pooled
(compressed) entries, with a learned per-head sink and a grouped low-rank output projection.

K = V: one `head_dim` vector per token serves as key and value. RoPE rotates the trailing
`rope_head_dim` channels of q and kv; because V carries that rotation, the output's rope channels
are rotated back by the query position. Sliding layers use the `main` rope; compressed layers use the
`compress` rope for everything, including their window branch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import (
    ChunkKeys,
    DecodeKeys,
    chunk_attention_applies,
    chunk_attention_in_place,
    decode_attention,
    decode_attention_in_place,
)
from kernels.batch_invariant import attend_one_query, batch_invariant_active
from kernels.norm import rms_norm_rope
from models.batch import DecodeBatch, ForwardBatch, SequenceChunk
from models.cache import LayerCache, PagedStore, paged_gather, paged_gather_rows, paged_pages, paged_read
from models.compressor import CompressedSparseCompressor, HeavilyCompressedCompressor, Indexer
from models.config import CSA, HCA, ModelConfig
from models.layers import GroupedLinear, RMSNorm, RotaryTable, apply_rope_, project_pair
from models.parallel import SINGLE, TensorParallel, mark_shards


def add_attention_projections(module: nn.Module, c: ModelConfig, tp: TensorParallel) -> int:
    """The projections V4 and V4.1 attention share, under HF's parameter names: low-rank q with its
    norm, the single K=V head with its norm, the grouped low-rank output, and the per-head sinks.
    Returns this rank's number of query heads.

    Tensor parallel: each rank takes an equal run of query heads and of o-groups. A group reads a fixed
    run of the flattened heads, so the rank's groups read exactly its heads: q_b_proj, the sinks and
    o_a_proj are cut by rows, o_b_proj by its input columns, and each rank's output is a partial sum
    the caller all-reduces (one all-reduce per layer). The shared K=V head, q's low-rank half, the
    compressors and indexers stay replicated: every rank keeps the whole cache."""
    heads, groups = tp.shard("num_attention_heads", c.num_heads), tp.shard("o_groups", c.o_groups)
    module.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
    module.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
    module.q_b_proj = nn.Linear(c.q_lora_rank, heads.size * c.head_dim, bias=False)
    module.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
    module.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
    module.o_a_proj = GroupedLinear(c.num_heads * c.head_dim // c.o_groups, groups.size * c.o_lora_rank, groups.size)
    module.o_b_proj = nn.Linear(groups.size * c.o_lora_rank, c.hidden_size, bias=False)
    module.sinks = nn.Parameter(torch.zeros(heads.size, dtype=torch.float32))
    mark_shards(module.q_b_proj, weight=tp.shard("num_attention_heads", c.num_heads, unit=c.head_dim))
    mark_shards(module.o_a_proj, weight=tp.shard("o_groups", c.o_groups, unit=c.o_lora_rank))
    mark_shards(module.o_b_proj, weight=tp.shard("o_groups", c.o_groups, unit=c.o_lora_rank, dim=1))
    mark_shards(module, sinks=heads)
    return heads.size


def attention_output(module: nn.Module, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The projections `add_attention_projections` made, applied to the heads' output [T, heads, dim]:
    its rope channels rotated back by the query position (in place: the attention kernels' fresh output),
    then the grouped low-rank output (a partial sum under tensor parallelism, completed here)."""
    out = apply_rope_(out, cos, sin, inverse=True)
    return module.tp.all_reduce(module.o_b_proj(module.o_a_proj(out.flatten(1))))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        c = config
        self.head_dim, self.window = c.head_dim, c.sliding_window
        self.eps = c.rms_norm_eps
        self.kind = c.layer_types[layer]
        self.tp = tp
        self.num_heads = add_attention_projections(self, c, tp)
        rate = c.compress_rates[layer]
        if self.kind == CSA:
            indexer = Indexer(
                c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk, rate, c.rms_norm_eps
            )
            self.compressor = CompressedSparseCompressor(c.hidden_size, c.head_dim, rate, c.rms_norm_eps, indexer)
        elif self.kind == HCA:
            self.compressor = HeavilyCompressedCompressor(c.hidden_size, c.head_dim, rate, c.rms_norm_eps)
        else:
            self.compressor = None
        self.rope = RotaryTable(c.main_rope if self.compressor is None else c.compress_rope)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        cos, sin, q_residual, q, kv = self._project(x, batch.positions)
        if self.compressor is not None:
            self.compressor.update(x, batch, cache.compressor, self.rope)
            if self.kind == CSA:
                self.compressor.indexer.update(x, batch, cache.indexer, self.rope)
        out = torch.empty_like(q)
        for chunk in batch.chunks:
            rows = chunk.rows
            out[rows] = self._attend_chunk(chunk, x[rows], q_residual[rows], q[rows], kv[rows], cache, cos[rows], sin[rows])
        return self._output(out, cos, sin)

    def decode(self, x: torch.Tensor, batch: DecodeBatch, cache: LayerCache) -> torch.Tensor:
        """One token per sequence with shapes fixed by the batch (capturable): the window ring's rows
        masked by position, then the compressed entries (CSA: the indexer's top-k of every entry the
        block table can hold; HCA: all of them), visible by position. A verify batch (`batch.waves`)
        appends every row's entry to the ring first, then updates the open groups wave by wave, so each
        row sees the entries its slot's earlier rows closed."""
        cos, sin, q_residual, q, kv = self._project(x, batch.positions)
        window_append(batch, kv, cache.window)
        entries, ids, rate = None, None, 0
        if self.compressor is not None:
            n = x.shape[0] // batch.waves
            for j in range(batch.waves):  # a verify step's rows of one slot update its open groups in order
                wave, rows = batch.wave(j), x[j * n: (j + 1) * n]
                self.compressor.decode_update(rows, wave, cache.compressor, self.rope)
                if self.kind == CSA:
                    self.compressor.indexer.decode_update(rows, wave, cache.indexer, self.rope)
            entries, rate = cache.compressor.entries, self.compressor.rate
            if self.kind == CSA:
                ids = self.compressor.indexer.decode_select(x, q_residual, batch, cache.indexer, cos, sin)
        out = attend_decode(q, batch, cache.window, self.window, entries, ids, rate, self.sinks, self.head_dim**-0.5)
        return self._output(out, cos, sin)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(cos, sin, q's low-rank residual, q [T, heads, head_dim], kv [T, head_dim]), both roped."""
        cos, sin = self.rope(positions)
        q_low, kv = project_pair(x, self.q_a_proj, self.kv_proj)
        q_residual = self.q_a_norm(q_low)
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim)
        q = rms_norm_rope(q, None, self.eps, cos, sin)  # each norm's output turned where it lies: one kernel
        kv = rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, cos, sin)
        return cos, sin, q_residual, q, kv

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return attention_output(self, out, cos, sin)

    def _attend_chunk(
        self,
        chunk: SequenceChunk,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: LayerCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        scale = self.head_dim**-0.5
        entries = cache.compressor.entries if self.compressor is not None else None
        if chunk_attention_applies(q, entries) and not batch_invariant_active():
            return chunk_attention_in_place(q, self._chunk_keys(chunk, x, q_residual, kv, cache, cos, sin), self.sinks,
                                            scale)
        keys, bias = window_keys(chunk, kv, cache.window, self.window)
        picked = limited = None
        if self.kind == CSA:
            picked = self._picked_entries(chunk, x, q_residual, cache, cos, sin)
        elif self.kind == HCA:
            limited = self._all_entries(chunk, cache)
        if batch_invariant_active():
            return attend_per_query(q, keys, bias, picked, self.sinks, scale, limited)
        return attend_in_row_tiles(q, keys, bias, picked, self.sinks, scale, limited)

    def _chunk_keys(
        self, chunk: SequenceChunk, x: torch.Tensor, q_residual: torch.Tensor, kv: torch.Tensor, cache: LayerCache,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> ChunkKeys:
        """The chunk's keys for the in-place kernel: the window's rows, then CSA's picked ids or HCA's
        every entry (limited by position), read through the block table where they lie."""
        source = window_source(chunk, kv, cache.window, self.window)
        if self.kind == CSA:
            ids = self.compressor.indexer.select(x, q_residual, chunk, cache.indexer, cos, sin)
            if ids is not None:
                source = replace(source, entries=cache.compressor.entries, pages=chunk.pages, ids=ids,
                                 entry_keys=ids.shape[1])
        elif self.kind == HCA:
            rate = self.compressor.rate
            source = replace(source, entries=cache.compressor.entries, pages=chunk.pages,
                             entry_keys=chunk.end_position // rate, rate=rate)
        return source

    def _picked_entries(
        self, chunk: SequenceChunk, x: torch.Tensor, q_residual: torch.Tensor, cache: LayerCache,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CSA: the entries the indexer picked for each query ([n, k, head_dim], and [n, k] valid), gathered
        from the pages, or None before the first entry closes. Attending to the k picked entries instead
        of every entry under a mask keeps the chunk's scores at [heads, n, window + n + k] at any context."""
        ids = self.compressor.indexer.select(x, q_residual, chunk, cache.indexer, cos, sin)
        if ids is None:
            return None
        return paged_gather(cache.compressor.entries, chunk.pages, ids.clamp(min=0)), ids >= 0

    def _all_entries(self, chunk: SequenceChunk, cache: LayerCache) -> LimitedEntries:
        """HCA: every entry of the sequence, each query seeing those closed at its position."""
        rate = self.compressor.rate
        entries = paged_read(cache.compressor.entries, chunk.pages, chunk.end_position // rate)
        positions = torch.arange(chunk.position, chunk.end_position, device=entries.device)
        return LimitedEntries(entries, (positions + 1) // rate)


@dataclass(frozen=True)
class LimitedEntries:
    """Entries every query of a chunk may attend (HCA's), query i only the first `limits[i]` of them:
    [E, dim] and [n]. Kept apart from the window's keys and mask so that no [n, E] mask is built."""

    entries: torch.Tensor
    limits: torch.Tensor


# the scores of one row tile of the torch path (heads x rows x keys, counted at 4 bytes): with the
# softmax's temporaries beside them, a few times this is the path's workspace at any context
ATTENTION_TILE_BYTES = 256 * 2**20


def attend_in_row_tiles(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, picked: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor, scale: float, limited: LimitedEntries | None = None, tile_bytes: int = ATTENTION_TILE_BYTES,
) -> torch.Tensor:
    """`attend_keys_and_picked` with HCA's `limited` entries after the shared keys, over tiles of the
    chunk's queries sized so that a tile's [heads, rows, keys] scores stay within `tile_bytes`: HCA's
    entries grow with the context (8,192 at 1M tokens on V4-Flash), and whole, a 2,048-token chunk's
    scores over them would be gigabytes the memory plan never saw (it profiles a chunk at position 0).
    Each query's output depends only on its own row, so tiles change no result beyond rounding."""
    n, heads, _ = q.shape
    if limited is not None:
        keys = torch.cat([keys, limited.entries])
        entry_ids = torch.arange(limited.entries.shape[0], device=q.device)
    width = keys.shape[0] + (picked[0].shape[1] if picked is not None else 0) + 1
    rows = max(1, tile_bytes // (4 * heads * width))
    out = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        tile_bias = bias[r0:r1]
        if limited is not None:
            hidden = entry_ids[None, :] >= limited.limits[r0:r1, None]
            entry_bias = torch.zeros(hidden.shape, dtype=bias.dtype, device=q.device).masked_fill(hidden, float("-inf"))
            tile_bias = torch.cat([tile_bias, entry_bias], 1)
        tile_picked = (picked[0][r0:r1], picked[1][r0:r1]) if picked is not None else None
        out.append(attend_keys_and_picked(q[r0:r1], keys, tile_bias, tile_picked, sinks, scale))
    return out[0] if len(out) == 1 else torch.cat(out)


def attend_keys_and_picked(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, picked: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Heads' outputs [n, heads, dim] of a chunk's queries q [n, heads, dim] over keys every query shares
    ([K, dim], additive `bias` [n, K]: the window, and HCA's entries) and the entries each query picked
    (`picked`: [n, k, dim] and [n, k] valid, or None), with one softmax over both and the sinks. Keys
    are values (MQA with K = V)."""
    columns = [torch.einsum("nhd,kd->hnk", q, keys) * scale + bias[None]]
    if picked is not None:
        entries, valid = picked
        picked_scores = torch.einsum("nhd,nkd->hnk", q, entries.to(q.dtype)) * scale
        columns.append(picked_scores.masked_fill(~valid[None], float("-inf")))
    columns.append(sinks.to(q.dtype)[:, None, None].expand(-1, q.shape[0], 1))
    logits = torch.cat(columns, dim=-1)
    probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1).to(q.dtype)
    n_keys = keys.shape[0]
    out = torch.einsum("hnk,kd->nhd", probs[..., :n_keys], keys)
    if picked is not None:
        out = out + torch.einsum("hnk,nkd->nhd", probs[..., n_keys:-1], picked[0].to(q.dtype))
    return out


def attend_per_query(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, picked: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor, scale: float, limited: LimitedEntries | None = None,
) -> torch.Tensor:
    """`attend_keys_and_picked` in deterministic mode: each query over exactly its visible shared keys,
    its `limited` entries and its valid picked entries (in pick order), batch-invariant."""
    out = []
    limits = limited.limits.tolist() if limited is not None else None
    for i in range(q.shape[0]):
        own = keys[bias[i] == 0]
        if limited is not None:
            own = torch.cat([own, limited.entries[: limits[i]].to(own.dtype)])
        if picked is not None:
            own = torch.cat([own, picked[0][i][picked[1][i]].to(own.dtype)])
        out.append(attend_one_query(q[i], own, sinks, scale))
    return torch.stack(out)


def window_keys(chunk: SequenceChunk, kv: torch.Tensor, ring: torch.Tensor, span: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_rows`' keys and the additive mask keeping (t - span, t] per query (`span`: the sliding
    window)."""
    keys, first = window_rows(chunk, kv, ring, span)
    device = kv.device
    key_positions = torch.arange(first, chunk.end_position, device=device)
    query_positions = torch.arange(chunk.position, chunk.end_position, device=device)[:, None]
    allowed = (key_positions[None, :] <= query_positions) & (key_positions[None, :] > query_positions - span)
    bias = torch.zeros(allowed.shape, dtype=kv.dtype, device=device).masked_fill(~allowed, float("-inf"))
    return keys, bias


def window_source(chunk: SequenceChunk, kv: torch.Tensor, ring: torch.Tensor, span: int) -> ChunkKeys:
    """The chunk's window keys for `chunk_attention_in_place` (`window_rows`, with the queries' positions);
    entries are added by the caller."""
    keys, first = window_rows(chunk, kv, ring, span)
    return ChunkKeys(keys, first, torch.arange(chunk.position, chunk.end_position, device=kv.device), span)


def window_rows(chunk: SequenceChunk, kv: torch.Tensor, ring: torch.Tensor, span: int) -> tuple[torch.Tensor, int]:
    """Keys of positions [p0 - span + 1, p1) (the ring's past rows, then the chunk's own) and the first
    of those positions; then stores the chunk's last ring-rows entries in the slot's ring (row = position
    % rows; rows >= span, more with draft tokens: ModelCache.allocate)."""
    p0, p1, rows = chunk.position, chunk.end_position, ring.shape[1]
    device = kv.device
    first = max(0, p0 - span + 1)
    past = torch.arange(first, p0, device=device)
    keys = torch.cat([ring[chunk.slot, past % rows], kv])
    stored = torch.arange(max(p0, p1 - rows), p1, device=device)
    ring[chunk.slot, stored % rows] = kv[stored - p0]
    return keys, first


def window_append(batch: DecodeBatch, kv: torch.Tensor, ring: torch.Tensor) -> None:
    """Stores each sequence's new entry in its slot's ring, at row position % window."""
    ring[batch.slots, batch.positions % ring.shape[1]] = kv.to(ring.dtype)


def attend_decode(
    q: torch.Tensor, batch: DecodeBatch, ring: torch.Tensor, span: int, entries: PagedStore | None,
    ids: torch.Tensor | None, rate: int, sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Decode attention of one query per sequence over the last `span` positions of its window ring (the
    new entry appended) and,
    with `entries`, the compressed entries: those at the picked `ids` [B, n] (-1: none), or every one
    the block table can hold; an entry is visible below (position + 1) // rate (rate 0: every picked
    one is). A plain tensor store of the ring's dtype is read in place by the kernel
    (kernels/attention.py, DecodeKeys); a packed one is unpacked by a gather first."""
    if entries is None or (isinstance(entries, torch.Tensor) and entries.dtype == ring.dtype):
        source = DecodeKeys(ring, batch.slots, batch.positions, entries, batch.block_tables if entries is not None else None,
                            ids, rate, span)
        return decode_attention_in_place(q, source, sinks, scale)
    keys, valid = gathered_window(batch, ring, span)
    if ids is None:
        compressed = paged_pages(entries, batch.block_tables).flatten(1, 2)
        ids = torch.arange(compressed.shape[1], device=q.device).expand(len(batch.positions), -1)
    else:
        compressed = paged_gather_rows(entries, batch.block_tables, ids.clamp(min=0))
    visible = (ids >= 0) & (ids < (batch.positions[:, None] + 1) // rate) if rate else ids >= 0
    keys, valid = torch.cat([keys, compressed.to(keys.dtype)], dim=1), torch.cat([valid, visible], dim=1)
    return decode_attention(q, keys, valid, sinks, scale)


def gathered_window(batch: DecodeBatch, ring: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's whole ring [B, rows, dim] and which rows hold a position of the query's window:
    row r holds p - ((p - r) mod rows), which lies in (p - rows, p] and is valid when it is >= 0 and
    within the last `span` positions."""
    width = ring.shape[1]
    rows = torch.arange(width, device=ring.device)[None, :]
    positions = batch.positions[:, None]
    held = positions - (positions - rows) % width
    return ring[batch.slots], (held >= 0) & (held > positions - span)
