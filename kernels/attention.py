"""Decode attention of DeepSeek-V4: one query per sequence over its gathered keys (K = V), with a
learned per-head sink logit that takes probability mass but adds no value.

Keys are [B, K, D]: the sliding-window ring's rows, then the compressed entries the layer reads (CSA:
the indexer's top-k; HCA: every entry the block table holds), and `valid` [B, K] masks rows that hold
no visible position. `decode_attention_reference` is the torch definition (the CPU path and the
oracle); on the GPU `decode_attention` runs two Triton kernels in place of the ~10 of the torch path:
an online softmax per (sequence, 16 heads, 64 keys), float32 throughout, then a merge of the splits
that adds the sink (so a row with no valid key yields zeros, never NaN).

`decode_attention_in_place` reads the same keys where they live (`DecodeKeys`: the window ring by the
sequence's slot, the paged compressed entries through its block table, by the indexer's picked ids or
all of them) and derives which are visible from the position, so a step needs no gathered copy of the
ring or of the picked entries, no concatenation and no mask tensors: ~13 launches a layer fewer, and
the copies (a 128 x 512 ring and up to 512 entries a sequence) are not written and read back. Its keys
come in the gathered path's order through the same tiles, so both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK_HEADS = 16
BLOCK_KEYS = 32
# One tile of keys a split, and 8 warps for the in-place kernel: at a batch of 1 a step has ~64 heads /
# 16 x (window + entries) / 32 programs, and a split's latency, not its work, sets the time. Measured
# on the H200 (nineteenth session, slice decode, released, context 0 / 8192): 64 keys x 4 warps 744 /
# 3,622 tok/s at batch 1 / 8; 32 x 4 763 / 3,677; 128 x 4 695 / 3,525; 64 x 8 759 / 3,665; 32 x 8
# 769 / 3,679.
KEYS_PER_SPLIT = 32
IN_PLACE_WARPS = 8


class ChunkTiles(NamedTuple):
    """The prefill chunk kernel's program: heads a program, keys a tile, warps, and Triton's software
    pipelining depth (key tiles in flight; 3 is its default on CUDA)."""

    block_heads: int
    block_keys: int
    warps: int
    stages: int = 3


# From scratch sweeps on the H200 (twentieth session; a 2,048-query chunk at 6,144 of V4-Flash, 64 heads of
# 512): the window alone 0.33 ms with 32 heads x 128 keys (the whole span, one tile) x 8 warps (16 x 32 x
# 4: 0.55; 16 x 32 x 8, the decode kernel's: 0.71); with entries, CSA's 512 picked 2.50 ms with 32 x 64 x 8
# and no software pipelining (3.27 with Triton's 3 stages, 5.69 with 16 x 32 x 8), HCA 0.87 ms with 32 x 64
# x 8 (1.28 with 16 x 32 x 8). 64 heads a program outgrow the shared memory at 32 keys and ran slower at 16.
WINDOW_CHUNK_TILES = ChunkTiles(32, 128, 8)
ENTRY_CHUNK_TILES = ChunkTiles(32, 64, 8, stages=1)


def decode_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D], keys [B, K, D], valid [B, K] bool, sinks [H] float32 -> [B, H, D] in q's dtype."""
    bias = torch.zeros(valid.shape, dtype=keys.dtype, device=keys.device).masked_fill(~valid, float("-inf"))
    scores = torch.einsum("bhd,bkd->bhk", q, keys) * scale + bias[:, None, :]
    sink = sinks.to(scores.dtype)[None, :, None].expand(scores.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)


@dataclass(frozen=True)
class DecodeKeys:
    """Where one decode query per sequence finds its keys (K = V), read in place.

    The window: `ring` [slots, rows, D], sequence b's at slot slots[b]; row r holds position
    p - ((p - r) mod rows) for the query at p = positions[b], a key when that is >= 0 and among the
    last `span` positions (None: all rows; a ring may have more rows than the window, for drafts).
    The compressed entries (optional): `entries` [pages, per_page, D] in the ring's dtype, entry e of sequence b at
    (tables[b, e // per_page], e % per_page). Key j after the window is entry ids[b, j] (the picked
    ids [B, n]; -1: none) or, without ids, entry j of every one the table can hold; it is a key when
    0 <= e < (p + 1) // rate (rate 0: no limit by position)."""

    ring: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    entries: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    rate: int = 0
    span: int | None = None

    @property
    def window(self) -> int:
        """The positions a query sees in its ring."""
        return self.ring.shape[1] if self.span is None else self.span

    @property
    def entry_keys(self) -> int:
        """Keys after the window a query walks."""
        if self.entries is None:
            return 0
        return self.ids.shape[1] if self.ids is not None else self.tables.shape[1] * self.entries.shape[1]


def gathered_keys_reference(source: DecodeKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys `source` describes, gathered: ([B, window + entry_keys, D] in the ring's dtype, valid
    [B, window + entry_keys]), the operands of `decode_attention`."""
    width = source.ring.shape[1]
    positions = source.positions[:, None]
    rows = torch.arange(width, device=positions.device)[None, :]
    held = positions - (positions - rows) % width
    keys, valid = [source.ring[source.slots]], [(held >= 0) & (held > positions - source.window)]
    if source.entries is not None:
        per_page = source.entries.shape[1]
        if source.ids is not None:
            ids = source.ids
        else:
            ids = torch.arange(source.entry_keys, device=positions.device).expand(len(source.positions), -1)
        limit = (positions + 1) // source.rate if source.rate else torch.full_like(positions, torch.iinfo(torch.int64).max)
        shown = (ids >= 0) & (ids < limit)
        safe = ids.clamp(min=0)
        pages = source.tables.gather(1, (safe // per_page).clamp(max=source.tables.shape[1] - 1))
        keys.append(source.entries[pages, safe % per_page].to(source.ring.dtype))
        valid.append(shown)
    return torch.cat(keys, dim=1), torch.cat(valid, dim=1)


def kernels_attend(q: torch.Tensor) -> bool:
    """Whether the Triton attention kernels take these queries: CUDA, half precision (float32 would run
    tl.dot in TF32), a power-of-two head size of at least 16."""
    head_dim = q.shape[-1]
    half = q.dtype in (torch.bfloat16, torch.float16)
    return triton is not None and q.is_cuda and half and not head_dim & (head_dim - 1) and head_dim >= 16


def decode_attention_in_place(q: torch.Tensor, source: DecodeKeys, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` over the keys `source` describes: the Triton kernel reads them where they
    are; elsewhere (CPU, float32) they are gathered for the reference."""
    if not kernels_attend(q):
        return decode_attention_reference(q, *gathered_keys_reference(source), sinks, scale)
    return decode_attention_in_place_triton(q, source, sinks, scale)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    if not kernels_attend(q):
        return decode_attention_reference(q, keys, valid, sinks, scale)
    return decode_attention_triton(q, keys, valid, sinks, scale)


def decode_attention_triton(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Split over keys (flash-decoding): each program covers KEYS_PER_SPLIT keys of 16 heads and
    writes its partial max / sum / weighted values; a second kernel merges the splits with the sink.
    A batch-1 step has only heads / 16 programs otherwise, each walking every key alone."""
    batch, heads, head_dim = q.shape
    n_keys = keys.shape[1]
    splits = max(1, triton.cdiv(n_keys, KEYS_PER_SPLIT))
    q, keys = q.contiguous(), keys.contiguous()
    valid = valid.to(torch.int8).contiguous()
    part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    _split_attention_kernel[(batch, triton.cdiv(heads, BLOCK_HEADS), splits)](
        q, keys, valid, part_max, part_sum, part_acc, scale, heads, n_keys, splits,
        D=head_dim, BLOCK_H=BLOCK_HEADS, BLOCK_K=BLOCK_KEYS, KEYS_PER_SPLIT=KEYS_PER_SPLIT, num_warps=4,
    )
    return _merge(q, part_max, part_sum, part_acc, sinks)


def decode_attention_in_place_triton(q: torch.Tensor, source: DecodeKeys, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention_triton`'s splits over the keys in place: a split's keys come from the ring or
    the entries (both when the window is not a multiple of KEYS_PER_SPLIT), tile by tile as the
    gathered kernel reads them."""
    batch, heads, head_dim = q.shape
    window = source.ring.shape[1]
    entry_keys = source.entry_keys
    splits = max(1, triton.cdiv(window + entry_keys, KEYS_PER_SPLIT))
    q = q.contiguous()
    ring = source.ring
    if not ring.is_contiguous():
        raise ValueError("the window ring must be contiguous")
    has_entries = source.entries is not None
    entries = source.entries if has_entries else ring
    if has_entries and (not entries.is_contiguous() or entries.dtype != ring.dtype):
        raise ValueError("the paged entries must be contiguous, of the ring's dtype")
    tables = source.tables if has_entries else source.slots
    ids = source.ids if source.ids is not None else source.slots
    part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    # slots and positions may be strided columns of one buffer (the decode graphs' inputs)
    _in_place_split_kernel[(batch, triton.cdiv(heads, BLOCK_HEADS), splits)](
        q, ring, source.slots, source.slots.stride(0), source.positions, source.positions.stride(0), entries, tables,
        tables.stride(0), ids, ids.stride(0), part_max, part_sum, part_acc, scale,
        heads, window, source.window, entry_keys, entries.shape[1] if has_entries else 1, source.rate, splits,
        HAS_ENTRIES=has_entries, HAS_IDS=source.ids is not None, D=head_dim, BLOCK_H=BLOCK_HEADS,
        BLOCK_K=BLOCK_KEYS, KEYS_PER_SPLIT=KEYS_PER_SPLIT, num_warps=IN_PLACE_WARPS,
    )
    return _merge(q, part_max, part_sum, part_acc, sinks)


@dataclass(frozen=True)
class ChunkKeys:
    """Where a prefill chunk's queries (one sequence; query i at positions[i]) find their keys, read in
    place. The window: `keys` [L, D], row r holding position `first` + r (the ring's past rows, then the
    chunk's own), query i seeing the last `span` positions up to its own. The entries (optional):
    `entries` [pages, per_page, D] in the keys' dtype through the sequence's block table `pages` [P];
    with `ids` [n, k] (picked, -1: none) query i's are ids[i], else entries 0 .. entry_keys - 1; an
    entry e is a key when e < (p + 1) // rate (rate 0: no limit by position)."""

    keys: torch.Tensor
    first: int
    positions: torch.Tensor
    span: int
    entries: torch.Tensor | None = None
    pages: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    entry_keys: int = 0
    rate: int = 0


def chunk_attention_applies(q: torch.Tensor, entries: object = None) -> bool:
    """Whether `chunk_attention_in_place` runs this chunk: `kernels_attend(q)`, and the entries (if any)
    a plain store of q's dtype."""
    plain = entries is None or (isinstance(entries, torch.Tensor) and entries.dtype == q.dtype)
    return kernels_attend(q) and plain


def chunk_attention_in_place(q: torch.Tensor, source: ChunkKeys, sinks: torch.Tensor, scale: float,
                             tiles: ChunkTiles | None = None) -> torch.Tensor:
    """A prefill chunk's attention (q [n, heads, D] -> [n, heads, D] in q's dtype) as the decode kernel
    does it, one program per (query, block of heads) walking that query's window rows and entries once,
    with the sinks folded in at the end: no [heads, n, keys] scores (the torch path scores every query
    against every window key of the chunk, 16x the visible ones at a 2,048-token chunk) and no
    gathered copy of the picked entries ([n, k, D] a layer). `tiles`: None picks the measured ones for
    the window alone or with entries."""
    n, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if not n:
        return out
    keys = source.keys.contiguous()
    has_entries = source.entries is not None and source.entry_keys > 0
    tiles = tiles or (ENTRY_CHUNK_TILES if has_entries else WINDOW_CHUNK_TILES)
    entries = source.entries if has_entries else keys
    if has_entries and (not entries.is_contiguous() or entries.dtype != keys.dtype):
        raise ValueError("the paged entries must be contiguous, of the window keys' dtype")
    pages = source.pages.contiguous() if has_entries else source.positions
    ids = source.ids.contiguous() if source.ids is not None else source.positions
    _chunk_attention_kernel[(n, triton.cdiv(heads, tiles.block_heads))](
        q.contiguous(), keys, source.first, keys.shape[0], source.positions.contiguous(), source.span, entries, pages,
        ids, ids.stride(0) if source.ids is not None else 0, source.entry_keys, entries.shape[1] if has_entries else 1,
        source.rate, sinks.float().contiguous(), out, scale, heads,
        HAS_ENTRIES=has_entries, HAS_IDS=source.ids is not None, D=head_dim, BLOCK_H=tiles.block_heads,
        BLOCK_K=tiles.block_keys, WINDOW_TILES=triton.cdiv(source.span, tiles.block_keys), num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out


def _merge(q: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor, part_acc: torch.Tensor,
           sinks: torch.Tensor) -> torch.Tensor:
    batch, heads, splits, head_dim = part_acc.shape
    out = torch.empty_like(q)
    _merge_splits_kernel[(batch, heads)](
        part_max, part_sum, part_acc, sinks.float().contiguous(), out, heads, splits,
        D=head_dim, SPLITS=triton.next_power_of_2(splits),
    )
    return out


if triton is not None:

    @triton.jit
    def _split_attention_kernel(
        q_ptr, keys_ptr, valid_ptr, max_ptr, sum_ptr, acc_ptr, scale, heads, n_keys, splits,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, KEYS_PER_SPLIT: tl.constexpr,
    ):
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        sequence, head, split, in_heads, dim, q = _program_queries(q_ptr, heads, D, BLOCK_H)
        running_max, running_sum, acc = _empty_split(BLOCK_H, D)
        keys_base = keys_ptr + sequence * n_keys * D
        for offset in range(0, KEYS_PER_SPLIT, BLOCK_K):
            key = split * KEYS_PER_SPLIT + offset + tl.arange(0, BLOCK_K)
            in_keys = key < n_keys
            usable = (tl.load(valid_ptr + sequence * n_keys + key, mask=in_keys, other=0) != 0) & in_keys
            block = tl.load(keys_base + key[:, None] * D + dim[None, :], mask=usable[:, None], other=0.0)
            running_max, running_sum, acc = _online_softmax_step(q, block, usable, scale, running_max, running_sum, acc)
        _store_split(max_ptr, sum_ptr, acc_ptr, running_max, running_sum, acc, sequence, head, in_heads, heads, split,
                     splits, D)

    @triton.jit
    def _program_queries(q_ptr, heads, D: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (sequence, block of heads, split): its ids, the heads' mask, the channels and q."""
        sequence = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_heads = head < heads
        dim = tl.arange(0, D)
        q = tl.load(q_ptr + sequence * heads * D + head[:, None] * D + dim[None, :], mask=in_heads[:, None], other=0.0)
        return sequence, head, tl.program_id(2), in_heads, dim, q

    @triton.jit
    def _empty_split(BLOCK_H: tl.constexpr, D: tl.constexpr):
        """A split's running max, sum and weighted values before its first key: one with no valid key
        keeps max -inf, sum 0, values 0 (the merge weighs it by 0)."""
        return (tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_H], dtype=tl.float32),
                tl.zeros([BLOCK_H, D], dtype=tl.float32))

    @triton.jit
    def _online_softmax_step(q, block, usable, scale, running_max, running_sum, acc):
        """One tile of keys (masked by `usable`) into a split's running max, sum and weighted values."""
        scores = tl.dot(q, tl.trans(block)) * scale  # [BLOCK_H, BLOCK_K] float32
        scores = tl.where(usable[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(block.dtype), block)
        return new_max, running_sum, acc

    @triton.jit
    def _store_split(max_ptr, sum_ptr, acc_ptr, running_max, running_sum, acc, sequence, head, in_heads, heads, split,
                     splits, D: tl.constexpr):
        part = (sequence * heads + head) * splits + split
        dim = tl.arange(0, D)
        tl.store(max_ptr + part, running_max, mask=in_heads)
        tl.store(sum_ptr + part, running_sum, mask=in_heads)
        tl.store(acc_ptr + part[:, None] * D + dim[None, :], acc, mask=in_heads[:, None])

    @triton.jit(do_not_specialize=["entry_keys", "table_stride", "ids_stride", "rate", "splits"])
    def _in_place_split_kernel(
        q_ptr, ring_ptr, slots_ptr, slots_stride, positions_ptr, positions_stride, entries_ptr, tables_ptr,
        table_stride, ids_ptr, ids_stride, max_ptr, sum_ptr, acc_ptr, scale, heads, window, span, entry_keys,
        per_page, rate, splits,
        HAS_ENTRIES: tl.constexpr, HAS_IDS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr, KEYS_PER_SPLIT: tl.constexpr,
    ):
        """Keys 0 .. window - 1 are the ring's rows (`window` of them, of which the last `span` positions
        are seen), the rest entries (DecodeKeys, of the ring's dtype); a tile's rows are addressed in
        whichever source holds each key and loaded at once."""
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        sequence, head, split, in_heads, dim, q = _program_queries(q_ptr, heads, D, BLOCK_H)
        position = tl.load(positions_ptr + sequence * positions_stride).to(tl.int64)
        ring_base = ring_ptr + tl.load(slots_ptr + sequence * slots_stride).to(tl.int64) * window * D
        # entries below (p + 1) // rate have closed (rate 0: every picked id is)
        limit = tl.where(rate > 0, (position + 1) // tl.maximum(rate, 1), position + (1 << 40))
        running_max, running_sum, acc = _empty_split(BLOCK_H, D)
        # unrolled: the tiles' id and page loads do not wait on each other's softmax, so they overlap
        for offset in tl.static_range(0, KEYS_PER_SPLIT, BLOCK_K):
            key = split * KEYS_PER_SPLIT + offset + tl.arange(0, BLOCK_K)
            in_ring = key < window
            # row r holds position p - ((p - r) mod window); p - r + window > 0 keeps the remainder's sign
            held = position - (position - key + window) % window
            usable = in_ring & (held >= 0) & (held > position - span)
            rows = ring_base + key * D
            if HAS_ENTRIES:
                j = key - window
                in_entries = (key >= window) & (j < entry_keys)
                if HAS_IDS:
                    entry = tl.load(ids_ptr + sequence * ids_stride + j, mask=in_entries, other=-1).to(tl.int64)
                else:
                    entry = j.to(tl.int64)
                entry_usable = in_entries & (entry >= 0) & (entry < limit)
                page = tl.load(tables_ptr + sequence * table_stride + entry // per_page, mask=entry_usable, other=0)
                # one load of one tile from either source (two tiles live at once spill at 512 channels)
                rows = tl.where(in_ring, rows, entries_ptr + (page.to(tl.int64) * per_page + entry % per_page) * D)
                usable = usable | entry_usable
            block = tl.load(rows[:, None] + dim[None, :], mask=usable[:, None], other=0.0)
            running_max, running_sum, acc = _online_softmax_step(q, block, usable, scale, running_max, running_sum, acc)
        _store_split(max_ptr, sum_ptr, acc_ptr, running_max, running_sum, acc, sequence, head, in_heads, heads, split,
                     splits, D)

    @triton.jit
    def _merge_splits_kernel(max_ptr, sum_ptr, acc_ptr, sinks_ptr, out_ptr, heads, splits, D: tl.constexpr, SPLITS: tl.constexpr):
        sequence = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        split = tl.arange(0, SPLITS)
        in_splits = split < splits
        base = (sequence * heads + head) * splits
        part_max = tl.load(max_ptr + base + split, mask=in_splits, other=float("-inf"))
        part_sum = tl.load(sum_ptr + base + split, mask=in_splits, other=0.0)
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(tl.max(part_max, axis=0), sink)  # finite: the sink is
        weight = tl.exp(part_max - top)  # 0 for splits without a valid key
        total = tl.exp(sink - top) + tl.sum(part_sum * weight, axis=0)
        dim = tl.arange(0, D)
        acc = tl.load(acc_ptr + (base + split)[:, None] * D + dim[None, :], mask=in_splits[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(out_ptr + (sequence * heads + head) * D + dim, out.to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["first", "n_keys", "span", "ids_stride", "entry_keys", "rate"])
    def _chunk_attention_kernel(
        q_ptr, keys_ptr, first, n_keys, positions_ptr, span, entries_ptr, pages_ptr, ids_ptr, ids_stride, entry_keys,
        per_page, rate, sinks_ptr, out_ptr, scale, heads,
        HAS_ENTRIES: tl.constexpr, HAS_IDS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr, WINDOW_TILES: tl.constexpr,
    ):
        """Program (query, block of heads): the window's `span` positions up to the query's (rows of the
        linear key buffer), then its entries tile by tile, one online softmax; the sink joins at the end."""
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        query, head, _, in_heads, dim, q = _program_queries(q_ptr, heads, D, BLOCK_H)
        position = tl.load(positions_ptr + query).to(tl.int64)
        running_max, running_sum, acc = _empty_split(BLOCK_H, D)
        for tile in tl.static_range(WINDOW_TILES):
            offset = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            held = position - (span - 1) + offset  # the position this key holds
            row = held - first
            usable = (offset < span) & (held >= 0) & (row >= 0) & (row < n_keys)
            block = tl.load(keys_ptr + row[:, None] * D + dim[None, :], mask=usable[:, None], other=0.0)
            running_max, running_sum, acc = _online_softmax_step(q, block, usable, scale, running_max, running_sum, acc)
        if HAS_ENTRIES:
            limit = tl.where(rate > 0, (position + 1) // tl.maximum(rate, 1), position + (1 << 40))
            for start in range(0, entry_keys, BLOCK_K):
                j = start + tl.arange(0, BLOCK_K)
                in_entries = j < entry_keys
                if HAS_IDS:
                    entry = tl.load(ids_ptr + query * ids_stride + j, mask=in_entries, other=-1).to(tl.int64)
                else:
                    entry = j.to(tl.int64)
                usable = in_entries & (entry >= 0) & (entry < limit)
                page = tl.load(pages_ptr + entry // per_page, mask=usable, other=0).to(tl.int64)
                rows = entries_ptr + (page * per_page + entry % per_page) * D
                block = tl.load(rows[:, None] + dim[None, :], mask=usable[:, None], other=0.0)
                running_max, running_sum, acc = _online_softmax_step(q, block, usable, scale, running_max, running_sum,
                                                                     acc)
        sink = tl.load(sinks_ptr + head, mask=in_heads, other=0.0)
        top = tl.maximum(running_max, sink)  # finite: the sink is
        weight = tl.exp(running_max - top)
        total = running_sum * weight + tl.exp(sink - top)
        out = acc * (weight / total)[:, None]
        tl.store(out_ptr + (query * heads + head)[:, None] * D + dim[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=in_heads[:, None])
