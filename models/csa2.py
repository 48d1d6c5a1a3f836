"""DeepSeek-V4.1 shared compressed attention ("CSA2"): the compressor of a kv source layer, the
lightning indexer of an index source layer, and the two-level top-k.

A kv source turns every complete group of r tokens into one compressed entry (r = 1: one entry per
token, no pooling) and keeps them per slot; the layers after it, up to the next source, attend the same
entries. An index source scores the entries for each query and publishes the top-k ids; the layers
after it reuse them. If a candidate source is configured, its per-block maxima choose a few blocks of
entries (the newest, partly filled block always among them) and every later index source picks its
top-k only inside them. Entry w (tokens w*r .. w*r+r-1) becomes visible to position t once t >= w*r+r-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0, stable_topk
from kernels.group_pool import group_pool
from kernels.index_topk import CandidateBlocks, block_maxima, choose_blocks
from models.batch import DecodeBatch, SequenceChunk
from models.cache import SharedStore, paged_write, paged_write_rows
from models.layers import RMSNorm, RotaryTable, apply_rope


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class ChunkSelection:
    """What index sources publish for one chunk's queries during one forward; later layers read it."""

    topk: torch.Tensor | None = None  # [n, k] entry ids, -1 = nothing; None before any index source ran
    candidate_blocks: torch.Tensor | None = None  # [n, n_blocks] bool, from the candidate source


class SharedCompressor(nn.Module):
    """kv source: latent_w = RMSNorm(sum over the group's tokens of kv * softmax(gate)) for r > 1, or
    RMSNorm(kv) per token for r = 1. Entries are stored RoPE'd (group's first position) and fp4-rounded."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, eps: float, simulate_quantization: bool) -> None:
        super().__init__()
        self.rate = rate
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        if rate > 1:
            self.gate_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.quantize = fake_quant_fp4_e4m3 if simulate_quantization else _identity

    def update(
        self, chunk: SequenceChunk, x: torch.Tensor, store: SharedStore, rope: RotaryTable, indexer: "SharedIndexer | None"
    ) -> None:
        """Appends the entries of the groups this chunk completes (and their index keys when `indexer`
        owns them); keeps the projections of a trailing open group in the slot's ring."""
        first, end = chunk.position // self.rate, chunk.end_position // self.rate
        latents = self._latents(chunk, x, store, first, end)
        if latents is None:
            return
        positions = torch.arange(first, end, device=x.device) * self.rate
        cos, sin = rope(positions)
        paged_write(store.entries, chunk.pages, first, self._rounded(store.entries, apply_rope(latents, cos, sin)))
        if indexer is not None:
            paged_write(store.index_keys, chunk.pages, first, indexer.keys(latents, cos, sin, store.index_keys))

    def decode_update(
        self, x: torch.Tensor, batch: DecodeBatch, store: SharedStore, rope: RotaryTable, indexer: "SharedIndexer | None"
    ) -> None:
        """One token per sequence, shapes fixed by the batch: the token joins its slot's open group, the
        group's latent is computed every step and its entry (and index key) written only where the
        token completes the group (r = 1: every token)."""
        rate, positions = self.rate, batch.positions
        group = positions // rate
        closes = None
        if rate == 1:
            latents = self.kv_norm(self.kv_proj(x))
        else:  # the token into its slot's ring (rate rows, more with draft rows), its group pooled from it
            kv = F.linear(x.float(), self.kv_proj.weight.float())
            gate = F.linear(x.float(), self.gate_proj.weight.float())
            pooled = group_pool(store.raw_kv, store.raw_gate, batch.slots, positions, kv, gate, rate)
            latents = self.kv_norm(pooled.to(x.dtype))
            closes = (positions + 1) % rate == 0
        cos, sin = rope(positions, rate)  # the group's first position: group * rate
        entries = self._rounded(store.entries, apply_rope(latents, cos, sin))
        paged_write_rows(store.entries, batch.block_tables, group, entries, closes)
        if indexer is not None:
            keys = indexer.keys(latents, cos, sin, store.index_keys)
            paged_write_rows(store.index_keys, batch.block_tables, group, keys, closes)

    def _rounded(self, store, entries: torch.Tensor) -> torch.Tensor:
        """What to hand the store: a packed store rounds as it packs (from the unrounded values, which
        packing an already-rounded entry would not always reproduce); a plain one stores the rounding."""
        return self.quantize(entries) if isinstance(store, torch.Tensor) else entries

    def _latents(
        self, chunk: SequenceChunk, x: torch.Tensor, store: SharedStore, first: int, end: int
    ) -> torch.Tensor | None:
        if self.rate == 1:
            return self.kv_norm(self.kv_proj(x))
        rate, p0, p1, ring = self.rate, chunk.position, chunk.end_position, store.raw_kv.shape[1]
        kv = F.linear(x.float(), self.kv_proj.weight.float())
        gate = F.linear(x.float(), self.gate_proj.weight.float())
        open_rows = torch.arange(first * rate, p0, device=x.device) % ring  # earlier tokens of the group the chunk starts in
        all_kv = torch.cat([store.raw_kv[chunk.slot, open_rows], kv])  # positions [first * rate, p1)
        all_gate = torch.cat([store.raw_gate[chunk.slot, open_rows], gate])
        # the chunk's last ring-rows tokens (the group left open after it among them): with draft rows, the
        # group a rejected draft closed is open again where the slot resumes, and its tokens are here
        tail = torch.arange(max(p0, p1 - ring), p1, device=x.device)
        store.raw_kv[chunk.slot, tail % ring] = kv[tail - p0]
        store.raw_gate[chunk.slot, tail % ring] = gate[tail - p0]
        if end == first:
            return None
        n = end - first
        grouped_kv = all_kv[: n * rate].view(n, rate, -1)
        weights = all_gate[: n * rate].view(n, rate, -1).softmax(dim=1)
        return self.kv_norm((grouped_kv * weights).sum(dim=1).to(x.dtype))


class SharedIndexer(nn.Module):
    """Lightning indexer of an index source: score(t, w) = sum_h weight[t, h] * relu(q[t, h] . key[w]) / sqrt(d).

    Keys are made only by an index source that is also a kv source (it owns `k_proj` / `k_norm`); a
    re-indexing source scores the most recent owner's keys with its own query and head weights."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, kv_head_dim: int, topk: int,
        owns_keys: bool, eps: float, simulate_quantization: bool,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        if owns_keys:
            self.k_proj = nn.Linear(kv_head_dim, head_dim, bias=False)
            self.k_norm = RMSNorm(head_dim, eps)
        self.quantize = fake_quant_fp4_ue8m0 if simulate_quantization else _identity

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store=None) -> torch.Tensor:
        """Index keys of new entries from their pre-RoPE latents (unrounded for a packed `store`, which
        rounds as it packs)."""
        keys = apply_rope(self.k_norm(self.k_proj(latents)), cos, sin)
        return self.quantize(keys) if isinstance(store, torch.Tensor) else keys

    def queries(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's roped (and rounded) queries [n, H, D] in the model's dtype and head weights [n, H]
        (scaled by H^-0.5) in float32: what kernels/index_topk.py scores with (its float32 products of
        the queries are exact either way)."""
        n = x.shape[0]
        q = self.quantize(apply_rope(self.q_b_proj(q_residual).view(n, self.n_heads, self.head_dim), cos, sin))
        return q, self.weights_proj(x).float() * self.n_heads**-0.5

    def top(self, scores: torch.Tensor) -> torch.Tensor | None:
        """[n, k] ids of the best entries (ties: lowest id), -1 where fewer than k are eligible."""
        k = min(self.topk, scores.shape[1])
        if k == 0:
            return None
        values, ids = stable_topk(scores, k)
        return ids.masked_fill(values == float("-inf"), -1)


def select_candidate_blocks(
    scores: torch.Tensor, visible_len: torch.Tensor, block_size: int, top_blocks: int
) -> torch.Tensor:
    """[n, n_blocks] bool: the blocks of `block_size` entries with the highest maximum score, the block
    holding each query's newest entry forced in. Blocks are absolute (block b = entries b*bs ..)."""
    return choose_blocks(block_maxima(scores, block_size), visible_len, CandidateBlocks(block_size, top_blocks))
