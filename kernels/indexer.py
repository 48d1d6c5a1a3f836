"""Lightning-indexer scores of one decode query per sequence against its paged index keys.

score(b, e) = sum_h w[b, h] * relu(q[b, h] . k[b, e]) / sqrt(head_dim), and -inf for entries the query
cannot see yet (e >= visible[b]); the caller takes the top-k. `indexer_scores_reference` gathers
every key the block table holds into a float32 tensor first (at a batch of 32 and an 8K table that
is a 34 MB temporary, plus the gather and einsum kernels around it); on the GPU `indexer_scores`
reads the keys straight from the pages, one Triton program per (sequence, 32 entries), in float32
with exact products (no TF32), so the top-k sees the reference's scores up to summation order.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK_ENTRIES = 32


def indexer_scores_reference(
    q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, tables: torch.Tensor, visible: torch.Tensor,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, H, D] (roped; used in float32), weights [B, H] (each head's weight: float32 of it times
    weight_scale), store [pages, per_page, D] (a tensor, or a packed store whose `.pages(tables)` unpacks),
    tables [B, P], visible [B] -> float32 scores [B, P * per_page]."""
    q, weights = q.float(), weights.float() * weight_scale
    keys = (store[tables] if isinstance(store, torch.Tensor) else store.pages(tables)).flatten(1, 2).float()
    scores = torch.relu(torch.einsum("bhd,bed->bhe", q, keys)) * q.shape[-1] ** -0.5
    seen = torch.arange(keys.shape[1], device=q.device)[None, :] < visible[:, None]
    return (scores * weights[..., None]).sum(dim=1).masked_fill(~seen, float("-inf"))


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, tables: torch.Tensor, visible: torch.Tensor,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """`indexer_scores_reference`; on the GPU q and the weights are read in their own dtype and made
    float32 (and the weights scaled) by the kernel, not by cast and scale kernels before it."""
    dim = q.shape[-1]
    packed = not isinstance(store, torch.Tensor)  # PackedPages: unpacked by the reference gather
    if triton is None or not q.is_cuda or dim & (dim - 1) or packed:
        return indexer_scores_reference(q, weights, store, tables, visible, weight_scale)
    return indexer_scores_triton(q, weights, store, tables, visible, weight_scale)


def indexer_scores_triton(
    q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, tables: torch.Tensor, visible: torch.Tensor,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    per_page = store.shape[1]
    n_entries = tables.shape[1] * per_page
    out = torch.empty(batch, n_entries, dtype=torch.float32, device=q.device)
    _indexer_scores_kernel[(batch, triton.cdiv(n_entries, BLOCK_ENTRIES))](
        q.contiguous(), weights.contiguous(), store, tables.contiguous(), visible.contiguous(), out,
        heads, per_page, tables.shape[1], n_entries, dim**-0.5, weight_scale, D=dim, BLOCK_E=BLOCK_ENTRIES,
    )
    return out


if triton is not None:

    @triton.jit
    def _indexer_scores_kernel(
        q_ptr, weights_ptr, store_ptr, tables_ptr, visible_ptr, out_ptr,
        heads, per_page, table_width, n_entries, scale, weight_scale, D: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        weight_scale = tl.cast(weight_scale, tl.float32)
        sequence = tl.program_id(0).to(tl.int64)
        entry = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        in_table = entry < n_entries
        page = tl.load(tables_ptr + sequence * table_width + entry // per_page, mask=in_table, other=0)
        dim = tl.arange(0, D)
        rows = page.to(tl.int64) * per_page + entry % per_page
        keys = tl.load(store_ptr + rows[:, None] * D + dim[None, :], mask=in_table[:, None], other=0.0).to(tl.float32)
        total = tl.zeros([BLOCK_E], dtype=tl.float32)
        for head in range(heads):
            query = tl.load(q_ptr + (sequence * heads + head) * D + dim).to(tl.float32)
            score = tl.sum(keys * query[None, :], axis=1)
            weight = tl.load(weights_ptr + sequence * heads + head).to(tl.float32) * weight_scale
            total += tl.maximum(score, 0.0) * scale * weight
        seen = entry < tl.load(visible_ptr + sequence)
        tl.store(out_ptr + sequence * n_entries + entry, tl.where(seen, total, float("-inf")), mask=in_table)
