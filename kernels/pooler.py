"""A window pooler's decode step (models/compressor.py, `WindowPooler.decode_update`) in one kernel.

Each step a pooler puts the token's raw (kv, gate) projections in its slot's ring, pools the entry of
the token's window from the ring (softmax over the window's tokens of gate + position bias, per
channel, weighting kv), RMS-norms it, turns it by RoPE at the window's first position and writes it to
the paged store where the token closes the window. In torch that is ~30 small kernels a pooler (ring
index puts, six gathers, masks, a cat, a softmax over a middle dim, the norm's and the rope's ops, the
paged write's gather and where), and a V4 decode step runs two poolers per CSA layer and one per HCA
layer: ~125 launches of a 4-layer step's ~290 (docs/decode-launches.md, G2). On the GPU
`pool_decode_triton` is two kernels: one program per (sequence, block of channel pairs) writes the
ring and pools its channels (the softmax is per channel), then one per sequence norms, turns and
stores the entry. One program per sequence for all of it measured ~50 us a call on the H200 (a window
of 128 tokens x 512 channels walked by one SM; thirteenth session's profile).

`combine_windows` and `pool_decode_reference` are the torch definitions: the CPU path, the prefill
path's pooling (models/compressor.py) and the kernel's oracle.

Layout: raw_kv / raw_gate are [slots, ring, width] in the model dtype, width = 2 * dim for the
overlapping form (CSA and the indexer: entry w pools the first half of window w-1's channels with the
second half of window w's) and dim otherwise (HCA). bias is [rate, width] float32.
"""

from __future__ import annotations

import torch

from kernels.norm import rms_norm
from kernels.rope import apply_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

SLOT_CHUNK = 16  # window tokens a program loads at once (a window of 128 takes 8 or 16 chunks)
PAIRS_PER_PROGRAM = 32  # channel pairs a pooling program owns (64 channels: 8 programs for 512)


def combine_windows(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor, prev_gate: torch.Tensor,
                    no_prev: torch.Tensor, bias: torch.Tensor, dim: int, overlap: bool) -> torch.Tensor:
    """Entries [n, dim], before the norm, from the raw projections [n, rate, width] of each window's
    tokens and (overlap only) of the window before it; `no_prev` [n] marks window 0, which has none."""
    if not overlap:
        slot_kv, slot_gate = kv, gate + bias
    else:
        missing = no_prev[:, None, None]
        prev_kv = prev_kv[..., :dim].masked_fill(missing, 0.0)
        prev_gate = (prev_gate[..., :dim] + bias[:, :dim]).masked_fill(missing, float("-inf"))
        slot_kv = torch.cat([prev_kv, kv[..., dim:]], dim=1)
        slot_gate = torch.cat([prev_gate, gate[..., dim:] + bias[:, dim:]], dim=1)
    # softmax over the window's tokens, taken along the last dim: the GPU's softmax over a middle dim
    # (a "spatial" softmax) is several times slower
    weights = slot_gate.transpose(1, 2).softmax(dim=-1).transpose(1, 2).to(slot_kv.dtype)
    return (slot_kv * weights).sum(dim=1)


def pool_decode_reference(raw_kv: torch.Tensor, raw_gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                          kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, cos: torch.Tensor, sin: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """The step's tokens (kv, gate [B, width]) join their slots' rings; returns each sequence's entry of
    its window [B, dim] (normed, turned by cos / sin [B, rope_dim / 2] of the window's first position)."""
    ring, width = raw_kv.shape[1], raw_kv.shape[2]
    dim = width // 2 if overlap else width
    raw_kv[slots, positions % ring] = kv.to(raw_kv.dtype)
    raw_gate[slots, positions % ring] = gate.to(raw_gate.dtype)
    window = positions // rate
    rows = (window[:, None] * rate + torch.arange(rate, device=positions.device)) % ring  # [B, rate]
    prev_rows = (rows - rate) % ring
    ring_rows = slots[:, None]
    entry = combine_windows(raw_kv[ring_rows, rows], raw_gate[ring_rows, rows], raw_kv[ring_rows, prev_rows],
                            raw_gate[ring_rows, prev_rows], window == 0, bias, dim, overlap)
    return apply_rope(rms_norm(entry, norm_weight, eps), cos, sin)


def pool_decode_applies(raw_kv: torch.Tensor, overlap: bool, rope_half: int) -> bool:
    """Whether `pool_decode_triton` runs this pooler: a GPU, and channel counts the kernel tiles."""
    dim = raw_kv.shape[2] // (2 if overlap else 1)
    half = dim // 2
    return (triton is not None and raw_kv.is_cuda and dim % 2 == 0 and half & (half - 1) == 0
            and 0 < rope_half <= half)


def pool_decode_triton(raw_kv: torch.Tensor, raw_gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, rate: int, overlap: bool,
                       store: torch.Tensor | None = None, tables: torch.Tensor | None = None) -> torch.Tensor:
    """`pool_decode_reference` on the GPU (see the module docstring). With a plain paged `store`
    [pages, per_page, dim] and the block `tables` [B, P], each sequence whose token closes its window
    (position + 1 a multiple of `rate`) also writes its entry there, at entry id position // rate.
    `slots`, `positions` and `tables` may be strided views (the decode graphs' static input rows)."""
    batch = positions.shape[0]
    ring, width = raw_kv.shape[1], raw_kv.shape[2]
    dim = width // 2 if overlap else width
    out = torch.empty(batch, dim, dtype=raw_kv.dtype, device=raw_kv.device)
    if batch == 0:
        return out
    for name, t in (("raw_kv", raw_kv), ("raw_gate", raw_gate), ("bias", bias)):
        if not t.is_contiguous():
            raise ValueError(f"pool_decode_triton: {name} must be contiguous")
    write = store is not None
    if write and (tables is None or store.dtype != raw_kv.dtype or not store.is_contiguous()):
        raise ValueError("pool_decode_triton: a store is written through its block tables, in the raw dtype")
    half = dim // 2
    pairs = min(PAIRS_PER_PROGRAM, half)
    blocks = half // pairs
    pooled = torch.empty(batch, dim, dtype=raw_kv.dtype, device=raw_kv.device)
    squares = torch.empty(batch, blocks, dtype=torch.float32, device=raw_kv.device)
    slots_count = (2 if overlap else 1) * rate
    _pool_window_kernel[(batch, blocks)](
        raw_kv, raw_gate, kv.contiguous(), gate.contiguous(), slots, positions, bias, pooled, squares,
        slots.stride(0), positions.stride(0), ring, rate,
        WIDTH=width, HALF=half, PAIRS=pairs, SLOTS=slots_count, OVERLAP=overlap,
        CHUNK=min(SLOT_CHUNK, triton.next_power_of_2(slots_count)), num_warps=4,
    )
    _pool_finish_kernel[(batch,)](
        pooled, squares, norm_weight, cos.float().contiguous(), sin.float().contiguous(), out,
        store if write else out, tables if write else positions, positions, positions.stride(0),
        tables.stride(0) if write else 0, store.shape[1] if write else 1, rate, eps,
        HALF=half, ROPE_HALF=cos.shape[-1], BLOCKS=blocks, WRITE=write, num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _window_slots(first, start, base, ring, rate, SLOTS: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr,
                      OVERLAP: tl.constexpr, CHUNK: tl.constexpr):
        """For window slots first .. first + CHUNK: (ring offset [CHUNK, 1] of each slot's channel 0, bias
        offset [CHUNK, 1], valid [CHUNK, 1]). With the overlap, slots [0, rate) are the previous window's
        tokens (first-half channels, none for window 0) and [rate, 2 rate) this window's (second-half
        channels, from offset DIM)."""
        slot = first + tl.arange(0, CHUNK)
        if OVERLAP:
            token = start + slot - rate
            valid = (slot < SLOTS) & (token >= 0)  # window 0 has no previous window
            offset = tl.where(slot < rate, 0, DIM)
        else:
            token = start + slot
            valid = slot < SLOTS
            offset = slot * 0
        row = (token + ring) % ring
        return (base + row * WIDTH + offset)[:, None], ((slot % rate) * WIDTH + offset)[:, None], valid[:, None]

    @triton.jit
    def _gates(raw_gate, bias, at, bias_at, channel, mask):
        """Gate + position bias of a chunk of slots [CHUNK, HALF] in float32; -inf where not a slot."""
        gate = tl.load(raw_gate + at + channel[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        return gate + tl.load(bias + bias_at + channel[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _weighted(raw_kv, raw_gate, bias, at, bias_at, channel, mask, peak, total):
        """Sum over a chunk of slots of kv times its softmax weight [HALF], each product rounded to
        the model dtype as the torch path's are."""
        weight = (tl.exp(_gates(raw_gate, bias, at, bias_at, channel, mask) - peak[None, :])
                  / total[None, :]).to(raw_kv.dtype.element_ty)
        value = tl.load(raw_kv + at + channel[None, :], mask=mask, other=0.0)
        return tl.sum((value * weight).to(raw_kv.dtype.element_ty).to(tl.float32), axis=0)

    @triton.jit
    def _pool_window_kernel(
        raw_kv, raw_gate, kv_new, gate_new, slots, positions, bias, pooled, squares,
        slot_stride, position_stride, ring, rate,
        WIDTH: tl.constexpr, HALF: tl.constexpr, PAIRS: tl.constexpr, SLOTS: tl.constexpr,
        OVERLAP: tl.constexpr, CHUNK: tl.constexpr,
    ):
        """Program (sequence, block of PAIRS channel pairs): the token's channels of the block join the
        ring, then the block's pooled entry channels (rounded to the model dtype) go to `pooled` and
        their sum of squares to `squares[sequence, block]`. A program reads back only the channels it
        wrote, so programs need no ordering between them."""
        DIM: tl.constexpr = 2 * HALF
        b = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        slot_id = tl.load(slots + b * slot_stride).to(tl.int64)
        position = tl.load(positions + b * position_stride).to(tl.int64)
        base = slot_id * ring * WIDTH
        # the token joins its ring first: its own window reads it back below
        for c in tl.static_range(0, WIDTH, DIM):
            channel = c + block * 2 * PAIRS + tl.arange(0, 2 * PAIRS)
            here = base + (position % ring) * WIDTH + channel
            tl.store(raw_kv + here, tl.load(kv_new + b * WIDTH + channel).to(raw_kv.dtype.element_ty))
            tl.store(raw_gate + here, tl.load(gate_new + b * WIDTH + channel).to(raw_gate.dtype.element_ty))
        tl.debug_barrier()

        window = position // rate
        start = window * rate
        pair = block * PAIRS + tl.arange(0, PAIRS)
        even, odd = 2 * pair, 2 * pair + 1
        # pass 1: each channel's max and sum of exp over the window's slots (online)
        peak_even = tl.full([PAIRS], -1.0e30, tl.float32)
        peak_odd = tl.full([PAIRS], -1.0e30, tl.float32)
        total_even = tl.zeros([PAIRS], tl.float32)
        total_odd = tl.zeros([PAIRS], tl.float32)
        for first in tl.range(0, SLOTS, CHUNK):
            at, bias_at, valid = _window_slots(first, start, base, ring, rate, SLOTS, DIM, WIDTH, OVERLAP, CHUNK)
            g_even = _gates(raw_gate, bias, at, bias_at, even, valid)
            g_odd = _gates(raw_gate, bias, at, bias_at, odd, valid)
            new_even = tl.maximum(peak_even, tl.max(g_even, axis=0))
            new_odd = tl.maximum(peak_odd, tl.max(g_odd, axis=0))
            total_even = total_even * tl.exp(peak_even - new_even) + tl.sum(tl.exp(g_even - new_even[None, :]), axis=0)
            total_odd = total_odd * tl.exp(peak_odd - new_odd) + tl.sum(tl.exp(g_odd - new_odd[None, :]), axis=0)
            peak_even, peak_odd = new_even, new_odd
        # pass 2: the weights, rounded to the model dtype as the torch path does, times kv
        acc_even = tl.zeros([PAIRS], tl.float32)
        acc_odd = tl.zeros([PAIRS], tl.float32)
        for first in tl.range(0, SLOTS, CHUNK):
            at, bias_at, valid = _window_slots(first, start, base, ring, rate, SLOTS, DIM, WIDTH, OVERLAP, CHUNK)
            acc_even += _weighted(raw_kv, raw_gate, bias, at, bias_at, even, valid, peak_even, total_even)
            acc_odd += _weighted(raw_kv, raw_gate, bias, at, bias_at, odd, valid, peak_odd, total_odd)
        # the pooled sum rounds to the model dtype before the norm, as the torch path's does
        x_even = acc_even.to(raw_kv.dtype.element_ty)
        x_odd = acc_odd.to(raw_kv.dtype.element_ty)
        tl.store(pooled + b * DIM + even, x_even)
        tl.store(pooled + b * DIM + odd, x_odd)
        e, o = x_even.to(tl.float32), x_odd.to(tl.float32)
        tl.store(squares + b * tl.num_programs(1) + block, tl.sum(e * e, axis=0) + tl.sum(o * o, axis=0))

    @triton.jit
    def _pool_finish_kernel(
        pooled, squares, norm_weight, cos, sin, out, store, tables, positions, position_stride, table_stride,
        per_page, rate, eps, HALF: tl.constexpr, ROPE_HALF: tl.constexpr, BLOCKS: tl.constexpr, WRITE: tl.constexpr,
    ):
        """One sequence: the RMS norm of its pooled entry (the blocks' sums of squares added in block
        order), RoPE at the window's first position, the entry out, and to its page where the token
        closes the window."""
        eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
        DIM: tl.constexpr = 2 * HALF
        b = tl.program_id(0).to(tl.int64)
        position = tl.load(positions + b * position_stride).to(tl.int64)
        window = position // rate
        pair = tl.arange(0, HALF)
        even, odd = 2 * pair, 2 * pair + 1
        total = tl.sum(tl.load(squares + b * BLOCKS + tl.arange(0, BLOCKS)), axis=0)
        scale = tl.rsqrt(total / DIM + eps)
        x_even = tl.load(pooled + b * DIM + even).to(tl.float32)
        x_odd = tl.load(pooled + b * DIM + odd).to(tl.float32)
        w_even = tl.load(norm_weight + even).to(tl.float32)
        w_odd = tl.load(norm_weight + odd).to(tl.float32)
        y_even = (w_even * (x_even * scale)).to(out.dtype.element_ty).to(tl.float32)
        y_odd = (w_odd * (x_odd * scale)).to(out.dtype.element_ty).to(tl.float32)
        # RoPE on the last 2 * ROPE_HALF channels: pair i turns by angle i - (HALF - ROPE_HALF)
        angle = pair - (HALF - ROPE_HALF)
        turned = angle >= 0
        c = tl.load(cos + b * ROPE_HALF + angle, mask=turned, other=1.0)
        s = tl.load(sin + b * ROPE_HALF + angle, mask=turned, other=0.0)
        r_even = tl.where(turned, y_even * c - y_odd * s, y_even).to(out.dtype.element_ty)
        r_odd = tl.where(turned, y_odd * c + y_even * s, y_odd).to(out.dtype.element_ty)
        tl.store(out + b * DIM + even, r_even)
        tl.store(out + b * DIM + odd, r_odd)
        if WRITE:
            if (position + 1) % rate == 0:
                page = tl.load(tables + b * table_stride + window // per_page).to(tl.int64)
                entry_at = (page * per_page + window % per_page) * DIM
                tl.store(store + entry_at + even, r_even)
                tl.store(store + entry_at + odd, r_odd)
