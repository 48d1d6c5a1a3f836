"""Lightning-indexer top-k over a prefill chunk in tiles: a workspace that does not grow with the
context.

score(i, e) = sum_h w[i, h] * relu(q[i, h] . key[e]) / sqrt(d), -inf for entries query i cannot see yet
(e >= visible[i]). Taken whole, the per-head products are a float32 [queries, heads, entries] tensor:
a 1,024-token chunk of V4.1-Flash at a 512K context (64 heads, 131,072 entries) asks for 32 GiB of it,
three times over (issue 24: the OOM at 137.5 GiB). Here the chunk's queries go in row tiles and the
entries in key tiles, each (rows x keys) tile's per-head products fit `tile_bytes`, and each row
tile keeps a running top-k: merging the best k so far (all of lower ids than the tile's) with the
tile's scores by a stable sort keeps the tie rule of one whole sort (among equal scores the lowest id
wins), so the ids are those of `stable_topk` over the whole score rows, in the same order.

V4.1's two-level selection rides along (models/csa2.py): the candidate source also takes, per query,
the blocks of `block_size` entries with the highest maximum score (the block of its newest visible
entry forced in); a constrained source scores only entries inside the blocks the candidate source
chose. Block maxima need the whole row, so a row tile holds its [rows, blocks] maxima (bounded the
same way) and the chunk's chosen blocks are a [queries, blocks] bool mask: the only result that grows
with the context, at one byte per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.topk import stable_topk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

# the float32 per-head products of one (rows x keys) tile; with a few same-sized temporaries beside
# them, about this times four is the scoring's peak at any context length
SCORE_TILE_BYTES = 256 * 2**20
KEY_TILE = 4096  # entries per key tile (rounded down to whole candidate blocks)
# the scoring kernel's program: queries x entries, warps. From a sweep on the H200 (twentieth session,
# V4-Flash's 64 heads of 128, a 2,048-query chunk against 8,192 entries)
SCORE_BLOCK_QUERIES = 64
SCORE_BLOCK_ENTRIES = 128
SCORE_WARPS = 4


@dataclass(frozen=True)
class CandidateBlocks:
    """The candidate source's rule: the `top_blocks` blocks of `block_size` entries with the highest
    maximum score, per query."""

    block_size: int
    top_blocks: int


@dataclass(frozen=True)
class IndexPick:
    """A chunk's selection: `ids` [n, k] entry ids in score order (-1 where fewer than k entries are
    eligible), None when there are no entries; `blocks` [n, n_blocks] bool, the candidate blocks
    (only when a CandidateBlocks rule was given)."""

    ids: torch.Tensor | None
    blocks: torch.Tensor | None = None


def head_weighted_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n, T] float32 scores of queries q [n, H, D] (float32 or the keys' dtype) with head weights [n, H]
    over keys [T, D], before any visibility mask."""
    per_head = torch.relu(torch.einsum("nhd,td->nht", q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (per_head * weights[..., None]).sum(dim=1)


def masked_scores_reference(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                            first: int = 0) -> torch.Tensor:
    """[n, T] float32: `head_weighted_scores` of keys [T, D], entries first .. first + T - 1, -inf at
    entries a query cannot see yet (at or past visible [n])."""
    entry = torch.arange(first, first + keys.shape[0], device=q.device)
    return head_weighted_scores(q, weights, keys).masked_fill(entry[None, :] >= visible[:, None], float("-inf"))


def scoring_kernel_applies(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """CUDA, queries and keys of one half-precision dtype (their products are exact in the kernel's
    float32 accumulator: the torch path's float32 scores up to summation order), a power-of-two
    head size of at least 16. Float32 models keep the torch path (a float32 dot would run as TF32
    or on the CUDA cores)."""
    dim = q.shape[-1]
    half = q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16)
    return triton is not None and q.is_cuda and half and not dim & (dim - 1) and dim >= 16


def masked_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                  first: int = 0) -> torch.Tensor:
    """`masked_scores_reference`, as one Triton kernel where `scoring_kernel_applies`: the per-head
    products stay in registers (the torch path writes and reads a float32 [n, H, T] tensor four
    times: the einsum, ReLU, scale and head weights, then the sum; ~20% of a 32K prefill on the H200)."""
    if not scoring_kernel_applies(q, keys):
        return masked_scores_reference(q, weights, keys, visible, first)
    return masked_scores_triton(q, weights, keys, visible, first)


def masked_scores_triton(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                         first: int = 0) -> torch.Tensor:
    n, heads, dim = q.shape
    total = keys.shape[0]
    out = torch.empty(n, total, dtype=torch.float32, device=q.device)
    if n and total:
        _masked_scores_kernel[(triton.cdiv(n, SCORE_BLOCK_QUERIES), triton.cdiv(total, SCORE_BLOCK_ENTRIES))](
            q.contiguous(), weights.float().contiguous(), keys.contiguous(), visible.contiguous(), out, n, total,
            first, heads, dim**-0.5, D=dim, BLOCK_M=SCORE_BLOCK_QUERIES, BLOCK_N=SCORE_BLOCK_ENTRIES,
            num_warps=SCORE_WARPS,
        )
    return out


def scores_per_query(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Deterministic mode: [n, T] float32 scores, each query over exactly its `visible` keys (-inf past
    them), one query at a time, so a query's scores do not depend on what shares its chunk."""
    q = q.float()
    scores = torch.full((q.shape[0], keys.shape[0]), float("-inf"), device=q.device)
    for i, count in enumerate(visible.tolist()):
        if count > 0:
            per_head = torch.relu(q[i] @ keys[:count].float().t()) * q.shape[-1] ** -0.5
            scores[i, :count] = (per_head * weights[i, :, None]).sum(dim=0)
    return scores


def topk_per_query(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int, *,
    candidates: CandidateBlocks | None = None, allowed: tuple[torch.Tensor, int] | None = None,
) -> IndexPick:
    """Deterministic mode's `indexer_topk`: each query scored over exactly its visible keys
    (`scores_per_query`) and its candidate blocks and top-k taken from that row alone, one query at a
    time, so a query's pick does not depend on what shares its chunk and no [n, T] scores exist (a row
    of T at a time; the chosen-blocks mask is the only result that grows with the context)."""
    n, total = q.shape[0], keys.shape[0]
    k = min(k, total)
    if k == 0:
        return IndexPick(None, None)
    block = candidates.block_size if candidates else allowed[1] if allowed else 1
    ids_out = torch.empty(n, k, dtype=torch.long, device=q.device)
    blocks_out = torch.empty(n, -(-total // block), dtype=torch.bool, device=q.device) if candidates else None
    for i in range(n):
        row = scores_per_query(q[i : i + 1], weights[i : i + 1], keys, visible[i : i + 1])
        if candidates:
            blocks_out[i : i + 1] = choose_blocks(block_maxima(row, block), visible[i : i + 1], candidates)
        elif allowed is not None:
            row = row.masked_fill(~expand_blocks(allowed[0][i : i + 1], total, block), float("-inf"))
        values, ids = stable_topk(row, k)
        ids_out[i] = ids[0].masked_fill(values[0] == float("-inf"), -1)
    return IndexPick(ids_out, blocks_out)


def block_maxima(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, ceil(T / block_size)]: each block's highest score (a partial last block padded with -inf)."""
    n, total = scores.shape
    n_blocks = -(-total // block_size)
    padded = F.pad(scores, (0, n_blocks * block_size - total), value=float("-inf"))
    return padded.view(n, n_blocks, block_size).amax(dim=-1)


def choose_blocks(block_max: torch.Tensor, visible: torch.Tensor, rule: CandidateBlocks) -> torch.Tensor:
    """[n, n_blocks] bool: the `rule.top_blocks` blocks of highest maximum (ties: lowest block), the
    block holding each query's newest visible entry forced in, blocks with nothing visible left out."""
    n, n_blocks = block_max.shape
    newest = torch.div(visible - 1, rule.block_size, rounding_mode="floor")
    forced = torch.arange(n_blocks, device=block_max.device)[None, :] == newest[:, None]
    values, ids = stable_topk(block_max.masked_fill(forced, float("inf")), min(rule.top_blocks, n_blocks))
    chosen = torch.zeros(n, n_blocks, dtype=torch.bool, device=block_max.device)
    return chosen.scatter_(1, ids, values > float("-inf"))


def expand_blocks(blocks: torch.Tensor, n_entries: int, block_size: int) -> torch.Tensor:
    """Block mask [n, n_blocks] -> entry mask [n, n_entries] (entries past the blocks are excluded)."""
    block_of_entry = torch.arange(n_entries, device=blocks.device) // block_size
    inside = block_of_entry < blocks.shape[1]
    return blocks[:, block_of_entry.clamp(max=max(blocks.shape[1] - 1, 0))] & inside[None, :]


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int, *,
    candidates: CandidateBlocks | None = None, allowed: tuple[torch.Tensor, int] | None = None,
    tile_bytes: int = SCORE_TILE_BYTES, key_tile: int = KEY_TILE,
) -> IndexPick:
    """The top `k` entries of each query (q [n, H, D] float32 or the keys' dtype, weights [n, H] float32)
    over `keys` [T, D] among its visible ones (visible [n]: entries below it), with V4.1's candidate
    blocks chosen (`candidates`) or obeyed (`allowed`: a chosen-blocks mask [n, n_blocks] and its block
    size)."""
    n, heads, _ = q.shape
    total = keys.shape[0]
    k = min(k, total)
    if k == 0:
        return IndexPick(None, None)
    block = candidates.block_size if candidates else allowed[1] if allowed else 1
    key_tile = max(block, min(key_tile, total) // block * block)
    n_blocks = -(-total // block)
    per_head = 1 if scoring_kernel_applies(q, keys) else heads  # the torch path's [rows, H, keys] products
    row_bytes = 4 * max(per_head * key_tile, n_blocks if candidates else 0)
    rows = max(1, tile_bytes // row_bytes)
    ids_out = torch.empty(n, k, dtype=torch.long, device=q.device)
    blocks_out = torch.empty(n, n_blocks, dtype=torch.bool, device=q.device) if candidates else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        best_values = torch.empty(r1 - r0, 0, device=q.device)
        best_ids = torch.empty(r1 - r0, 0, dtype=torch.long, device=q.device)
        maxima = []
        for t0 in range(0, total, key_tile):
            t1 = min(total, t0 + key_tile)
            entry = torch.arange(t0, t1, device=q.device)
            scores = masked_scores(q[r0:r1], weights[r0:r1], keys[t0:t1], visible[r0:r1], t0)
            if candidates:
                maxima.append(block_maxima(scores, block))
            elif allowed is not None:
                chosen = allowed[0][r0:r1, t0 // block : -(-t1 // block)]
                if chosen.shape[1]:
                    scores = scores.masked_fill(~expand_blocks(chosen, t1 - t0, block), float("-inf"))
                else:  # the tile lies past every block the mask covers
                    scores = torch.full_like(scores, float("-inf"))
            values = torch.cat([best_values, scores], dim=1)
            best_values, order = stable_topk(values, min(k, values.shape[1]))
            best_ids = torch.cat([best_ids, entry.expand(r1 - r0, -1)], dim=1).gather(1, order)
        ids_out[r0:r1] = best_ids.masked_fill(best_values == float("-inf"), -1)
        if candidates:
            blocks_out[r0:r1] = choose_blocks(torch.cat(maxima, dim=1), visible[r0:r1], candidates)
    return IndexPick(ids_out, blocks_out)


if triton is not None:

    @triton.jit(do_not_specialize=["n", "total", "first"])
    def _masked_scores_kernel(q_ptr, weights_ptr, keys_ptr, visible_ptr, out_ptr, n, total, first, heads, scale,
                              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (block of queries, block of entries): for each head in order, the [queries, entries]
        products on the tensor cores, then ReLU, the scale and the head weight in float32 as the torch
        path applies them; -inf where an entry is not visible yet."""
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows, in_cols = rows < n, cols < total
        dim = tl.arange(0, D)
        keys = tl.load(keys_ptr + cols[:, None].to(tl.int64) * D + dim[None, :], mask=in_cols[:, None], other=0.0)
        total_scores = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for head in range(heads):
            q = tl.load(q_ptr + (rows[:, None].to(tl.int64) * heads + head) * D + dim[None, :], mask=in_rows[:, None],
                        other=0.0)
            weight = tl.load(weights_ptr + rows.to(tl.int64) * heads + head, mask=in_rows, other=0.0)
            products = tl.dot(q, tl.trans(keys))
            total_scores += tl.maximum(products, 0.0) * scale * weight[:, None]
        seen = (first + cols)[None, :] < tl.load(visible_ptr + rows, mask=in_rows, other=0)[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * total + cols[None, :], tl.where(seen, total_scores, float("-inf")),
                 mask=in_rows[:, None] & in_cols[None, :])
