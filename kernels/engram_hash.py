"""A decode step's Engram row ids hashed in one kernel (V4.1's n-gram hashing on the device).

Each sequence of a decode step adds one token; its row ids in every Engram layer's table are the XOR
mixes of its last n compressed tokens times per-layer multipliers, modulo a prime per column
(engram_store/hashing.py states the rule; NgramHasher.next_row_ids_tensor is its torch statement and
this kernel's reference, with models/engram.py's look-back update). Done by torch ops that is ~25
launches a step, ~0.75 ms of host time on the H200 (bench.engram's fetch, fifteenth session), for
work that is a few dozen integer ops a sequence: here one program a sequence hashes every layer's
columns in registers and advances the sequence's carried look-back in place.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path runs
    triton = None

DEAD = -1  # engram_store/hashing.DEAD: a blocked look-back entry


def hash_decode_rows_triton(slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                            context: torch.Tensor, lookup: torch.Tensor, multipliers: torch.Tensor,
                            primes: torch.Tensor, offsets: torch.Tensor, pad: int, heads: int) -> torch.Tensor:
    """Row ids [N, L, cols] of each sequence's next token (int64 `slots`, `token_ids`, `positions`
    [N]), its look-back read from and advanced in `context` [slots, n - 1] (oldest first; none at
    position 0). `lookup`: token -> compressed id; `multipliers` [L, n]; `primes`, `offsets` [L, cols]."""
    n_seq = token_ids.shape[0]
    layers, cols = primes.shape
    out = torch.empty(n_seq, layers, cols, dtype=torch.int64, device=token_ids.device)
    if n_seq:
        _hash_kernel[(n_seq,)](
            slots.contiguous(), token_ids.contiguous(), positions.contiguous(), context, lookup,
            multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, pad, layers, cols, heads,
            CTX=context.shape[1], LP=triton.next_power_of_2(layers), CP=triton.next_power_of_2(cols), DEAD=DEAD)
    return out


if triton is not None:

    @triton.jit
    def _hash_kernel(slots_ptr, tokens_ptr, positions_ptr, context_ptr, lookup_ptr, mult_ptr, primes_ptr,
                     offsets_ptr, out_ptr, pad, layers, cols, heads,
                     CTX: tl.constexpr, LP: tl.constexpr, CP: tl.constexpr, DEAD: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(slots_ptr + i)
        start = tl.load(positions_ptr + i) == 0  # no look-back before a sequence's first token
        current = tl.load(lookup_ptr + tl.load(tokens_ptr + i))
        layer = tl.arange(0, LP)[:, None]
        col = tl.arange(0, CP)[None, :]
        valid = (layer < layers) & (col < cols)
        order = col // heads  # column's n-gram order minus 2: it mixes tokens k = 0 .. order + 1
        stride = CTX + 1  # multipliers per layer
        blocked = current == DEAD
        token = tl.where(blocked, pad, current)
        mix = tl.zeros([LP, CP], dtype=tl.int64) + token * tl.load(mult_ptr + layer * stride, mask=layer < layers, other=0)
        for k in tl.static_range(1, CTX + 1):
            back = tl.load(context_ptr + slot * CTX + (CTX - k))  # k tokens back (the context is oldest first)
            back = tl.where(start, DEAD, back)
            blocked = blocked | (back == DEAD)
            token = tl.where(blocked, pad, back)
            term = token * tl.load(mult_ptr + layer * stride + k, mask=layer < layers, other=0)
            mix = tl.where(order >= k - 1, mix ^ term, mix)
        at = layer * cols + col
        prime = tl.load(primes_ptr + at, mask=valid, other=1)
        offset = tl.load(offsets_ptr + at, mask=valid, other=0)
        tl.store(out_ptr + i * layers * cols + at, mix % prime + offset, mask=valid)
        # the carried look-back, one token on: drop the oldest, append this token
        for j in tl.static_range(CTX - 1):
            kept = tl.load(context_ptr + slot * CTX + j + 1)
            tl.store(context_ptr + slot * CTX + j, tl.where(start, DEAD, kept))
        tl.store(context_ptr + slot * CTX + CTX - 1, current)
