"""DeepSeek-V4.1 attention: window MQA over fp8-rounded K=V plus, on layers with a compress ratio,
the compressed entries the layer's index source picked for each query (shared CSA2 state).

Differences from V4 (models/attention.py): no per-head norm on q; the window K=V is rounded through
fp8 (ue8m0 per 32) before it is cached; compressed entries come from the most recent kv source's store
and the selection from the most recent index source, so a layer may own neither. Every query sees
its window keys, its picked entries and the head's sink as separate softmax columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from kernels import fake_quant_fp8_ue8m0
from kernels.attention import chunk_attention_applies, chunk_attention_in_place
from kernels.batch_invariant import batch_invariant_active
from kernels.index_topk import CandidateBlocks, expand_blocks, indexer_topk, topk_per_query
from kernels.indexer import indexer_scores
from kernels.norm import rms_norm_rope
from models.attention import (
    add_attention_projections,
    attend_decode,
    attend_keys_and_picked,
    attend_per_query,
    attention_output,
    window_append,
    window_keys,
    window_source,
)
from models.batch import DecodeBatch, ForwardBatch, SequenceChunk
from models.cache import ModelCache, paged_gather, paged_read
from models.config import ModelConfig
from models.csa2 import ChunkSelection, SharedCompressor, SharedIndexer, select_candidate_blocks
from models.layers import RotaryTable, apply_rope_, project_pair
from models.parallel import SINGLE, TensorParallel


@dataclass
class SelectionTrace:
    """Debug record of what the index sources chose, per layer, one entry per chunk in batch order."""

    topk: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    candidates: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # entry masks [n, T]
    engram_row_ids: list[torch.Tensor] = field(default_factory=list)  # [T, engram layers, columns] per forward


class SharedCompressedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        c, shared = config, config.shared_compression
        self.layer, self.head_dim, self.tp, self.window = layer, c.head_dim, tp, c.sliding_window
        self.num_heads = add_attention_projections(self, c, tp)
        self.quantize_kv = fake_quant_fp8_ue8m0 if c.simulate_quantization else (lambda x: x)
        compressed = c.compress_rates[layer] > 0
        self.rope = RotaryTable(c.compress_rope if compressed else c.main_rope)
        # Where this layer's compressed branch reads from (None: window only).
        self.kv_source = shared.kv_source_for(layer) if compressed else None
        key_owners = [i for i in shared.index_sources if i in shared.kv_sources and i <= layer]
        self.key_source = key_owners[-1] if key_owners else None
        self.visible_rate = c.compress_rates[self.kv_source] if self.kv_source is not None else 0
        self.key_rate = c.compress_rates[self.key_source] if self.key_source is not None else 0
        self.compressor = None
        if layer in shared.kv_sources:
            self.compressor = SharedCompressor(
                c.hidden_size, c.head_dim, c.compress_rates[layer], c.rms_norm_eps, c.simulate_quantization
            )
        self.indexer = None
        if layer in shared.index_sources:
            self.indexer = SharedIndexer(
                c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.head_dim, c.index_topk,
                owns_keys=layer in shared.kv_sources, eps=c.rms_norm_eps, simulate_quantization=c.simulate_quantization,
            )
        # The indexer that also turns this layer's new entries into index keys.
        self.key_maker = self.indexer if self.compressor is not None and self.indexer is not None else None
        self.is_candidate_source = layer == shared.candidate_source
        self.constrained = shared.candidate_source is not None and shared.candidate_source < layer
        self.block_size, self.top_blocks = shared.candidate_block_size, shared.candidate_topk_blocks

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: ModelCache,
        selections: list[ChunkSelection],
        trace: SelectionTrace | None,
    ) -> torch.Tensor:
        if isinstance(batch, DecodeBatch):
            return self.decode(x, batch, cache, selections[0])
        n_tokens = x.shape[0]
        cos, sin = self.rope(batch.positions)
        q_low, kv = project_pair(x, self.q_a_proj, self.kv_proj)
        q_residual = self.q_a_norm(q_low)
        q = apply_rope_(self.q_b_proj(q_residual).view(n_tokens, self.num_heads, self.head_dim), cos, sin)
        kv = self.quantize_kv(rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, cos, sin))
        out = torch.empty_like(q)
        for index, chunk in enumerate(batch.chunks):
            rows = chunk.rows
            if self.compressor is not None:
                self.compressor.update(chunk, x[rows], cache.layers[self.layer].shared, self.rope, self.key_maker)
            if self.indexer is not None:
                self._select(chunk, x[rows], q_residual[rows], cache, selections[index], cos[rows], sin[rows], trace)
            out[rows] = self._attend_chunk(chunk, q[rows], kv[rows], cache, selections[index])
        return attention_output(self, out, cos, sin)

    def decode(self, x: torch.Tensor, batch: DecodeBatch, cache: ModelCache, selection: ChunkSelection) -> torch.Tensor:
        """One token per sequence with shapes fixed by the batch (capturable): the window ring's rows,
        then the entries the latest index source picked, through the decode attention kernel. A verify
        batch (`batch.waves`) updates its kv source's open groups wave by wave (a slot's later row pools
        the ring rows its earlier ones wrote), then scores and attends every row at once: a row sees only
        the keys, entries and ring rows its position makes visible."""
        cos, sin = self.rope(batch.positions)
        q_low, kv = project_pair(x, self.q_a_proj, self.kv_proj)
        q_residual = self.q_a_norm(q_low)
        q = apply_rope_(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)
        kv = self.quantize_kv(rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, cos, sin))
        layer = cache.layers[self.layer]
        if self.compressor is not None:
            n = x.shape[0] // batch.waves
            for j in range(batch.waves):
                self.compressor.decode_update(x[j * n: (j + 1) * n], batch.wave(j), layer.shared, self.rope,
                                              self.key_maker)
        if self.indexer is not None:
            self._decode_select(x, q_residual, batch, cache, selection, cos, sin)
        window_append(batch, kv, layer.window)
        entries, ids = None, None
        if self.kv_source is not None and selection.topk is not None:
            entries, ids = cache.layers[self.kv_source].shared.entries, selection.topk
        out = attend_decode(q, batch, layer.window, self.window, entries, ids, 0, self.sinks, self.head_dim**-0.5)
        return attention_output(self, out, cos, sin)

    def _decode_select(
        self, x: torch.Tensor, q_residual: torch.Tensor, batch: DecodeBatch, cache: ModelCache,
        selection: ChunkSelection, cos: torch.Tensor, sin: torch.Tensor,
    ) -> None:
        """`_select` for one query per sequence over every key its block table can hold. A query sees
        the key owner's entries complete at its position, and no more than the kv source's."""
        indexer = self.indexer
        visible = torch.div(batch.positions + 1, self.visible_rate, rounding_mode="floor")
        keys_made = torch.div(batch.positions + 1, self.key_rate, rounding_mode="floor")
        q = indexer.quantize(apply_rope_(indexer.q_b_proj(q_residual).view(-1, indexer.n_heads, indexer.head_dim), cos, sin))
        store = cache.layers[self.key_source].shared.index_keys
        scores = indexer_scores(q, indexer.weights_proj(x), store, batch.block_tables, torch.minimum(visible, keys_made),
                                weight_scale=indexer.n_heads**-0.5)
        if self.is_candidate_source:
            selection.candidate_blocks = select_candidate_blocks(scores, visible, self.block_size, self.top_blocks)
        elif self.constrained and selection.candidate_blocks is not None:
            allowed = expand_blocks(selection.candidate_blocks, scores.shape[1], self.block_size)
            scores = scores.masked_fill(~allowed, float("-inf"))
        selection.topk = indexer.top(scores)

    def _attend_chunk(self, chunk: SequenceChunk, q: torch.Tensor, kv: torch.Tensor, cache: ModelCache,
                      selection: ChunkSelection) -> torch.Tensor:
        """The chunk's window and picked entries: in place on CUDA (kernels/attention.py's
        chunk_attention_in_place, where the kv source's entries are a plain store of q's dtype), else
        the torch path over the gathered keys."""
        ring = cache.layers[self.layer].window
        picks = self.kv_source is not None and selection.topk is not None
        entries = cache.layers[self.kv_source].shared.entries if picks else None
        if chunk_attention_applies(q, entries) and not batch_invariant_active():
            source = window_source(chunk, kv, ring, self.window)
            if picks:
                source = replace(source, entries=entries, pages=chunk.pages, ids=selection.topk,
                                 entry_keys=selection.topk.shape[1])
            return chunk_attention_in_place(q, source, self.sinks, self.head_dim**-0.5)
        keys, bias = window_keys(chunk, kv, ring, self.window)
        return self._attend(q, keys, bias, self._picked_entries(chunk, cache, selection))

    def _picked_entries(
        self, chunk: SequenceChunk, cache: ModelCache, selection: ChunkSelection
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([n, k, head_dim] entries, [n, k] valid) each query attends besides its window, or None."""
        if self.kv_source is None or selection.topk is None:
            return None
        ids = selection.topk
        return paged_gather(cache.layers[self.kv_source].shared.entries, chunk.pages, ids.clamp(min=0)), ids >= 0

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, picked: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        attend = attend_per_query if batch_invariant_active() else attend_keys_and_picked
        return attend(q, keys, bias, picked, self.sinks, self.head_dim**-0.5)

    def _select_per_query(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
        selection: ChunkSelection, allowed: torch.Tensor | None,
    ) -> None:
        """`_select` in deterministic mode: each query over exactly its visible keys, a query at a time."""
        pick = topk_per_query(
            q, head_weights, keys, visible, self.indexer.topk,
            candidates=CandidateBlocks(self.block_size, self.top_blocks) if self.is_candidate_source else None,
            allowed=(allowed, self.block_size) if allowed is not None and not self.is_candidate_source else None,
        )
        selection.topk = pick.ids
        if self.is_candidate_source:
            selection.candidate_blocks = pick.blocks

    def _select(
        self,
        chunk: SequenceChunk,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cache: ModelCache,
        selection: ChunkSelection,
        cos: torch.Tensor,
        sin: torch.Tensor,
        trace: SelectionTrace | None,
    ) -> None:
        """Scores the entries of the latest key owner for the chunk's queries and publishes the top-k."""
        n_keys = chunk.end_position // self.key_rate
        positions = torch.arange(chunk.position, chunk.end_position, device=x.device)
        visible = torch.div(positions + 1, self.visible_rate, rounding_mode="floor")
        selection.topk = None
        if n_keys > 0:
            keys = paged_read(cache.layers[self.key_source].shared.index_keys, chunk.pages, n_keys)
            q, head_weights = self.indexer.queries(x, q_residual, cos, sin)
            allowed = selection.candidate_blocks if self.constrained else None
            if batch_invariant_active():
                self._select_per_query(q, head_weights, keys, visible, selection, allowed)
            else:
                pick = indexer_topk(
                    q, head_weights, keys, visible, self.indexer.topk,
                    candidates=CandidateBlocks(self.block_size, self.top_blocks) if self.is_candidate_source else None,
                    allowed=(allowed, self.block_size) if allowed is not None and not self.is_candidate_source else None,
                )
                selection.topk = pick.ids
                if self.is_candidate_source:
                    selection.candidate_blocks = pick.blocks
            if trace is not None and self.is_candidate_source:
                mask = expand_blocks(selection.candidate_blocks, n_keys, self.block_size)
                trace.candidates.setdefault(self.layer, []).append(mask)
        if trace is not None:
            trace.topk.setdefault(self.layer, []).append(selection.topk)
