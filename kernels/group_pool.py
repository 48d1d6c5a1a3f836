"""V4.1's shared compressor at decode (models/csa2.py, `SharedCompressor.decode_update`, rate > 1) in one kernel.

Each step the token's float32 (kv, gate) projections join its slot's ring at row position % ring, and its
group's pooled latent is computed from the ring: per channel, the softmax over the group's `rate` tokens of
gate weighting kv, summed in float32. In torch that is ~14 small kernels a layer (two ring index puts and
their remainders, the group's row indices, two gathers, a softmax over a middle dim, a product, a sum);
`group_pool_triton` is one program per (sequence, block of channels), each writing and then reading only
its own channels of the ring, so programs need no ordering between them. `group_pool_reference` is the
torch definition (the CPU path and the oracle). The sums run in another order than torch's reductions, so
the two agree to float32 rounding, not bit for bit.

Layout: raw_kv / raw_gate [slots, ring, dim] float32 (ring >= rate: `rate` rows, more with draft rows);
kv / gate [B, dim] float32, the step's projections; slots / positions [B] (may be strided views).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

CHANNELS_PER_PROGRAM = 64


def group_pool(raw_kv: torch.Tensor, raw_gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               kv: torch.Tensor, gate: torch.Tensor, rate: int) -> torch.Tensor:
    """The token's projections into the ring, then its group's pooled latent [B, dim] float32."""
    if triton is None or not raw_kv.is_cuda or not (raw_kv.is_contiguous() and raw_gate.is_contiguous()):
        return group_pool_reference(raw_kv, raw_gate, slots, positions, kv, gate, rate)
    return group_pool_triton(raw_kv, raw_gate, slots, positions, kv, gate, rate)


def group_pool_reference(raw_kv: torch.Tensor, raw_gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                         kv: torch.Tensor, gate: torch.Tensor, rate: int) -> torch.Tensor:
    ring = raw_kv.shape[1]
    raw_kv[slots, positions % ring] = kv
    raw_gate[slots, positions % ring] = gate
    rows = ((positions // rate * rate)[:, None] + torch.arange(rate, device=kv.device)) % ring  # the group's tokens
    grouped_kv, grouped_gate = raw_kv[slots[:, None], rows], raw_gate[slots[:, None], rows]
    weights = grouped_gate.transpose(1, 2).softmax(dim=-1).transpose(1, 2)  # over the group's tokens
    return (grouped_kv * weights).sum(dim=1)


def group_pool_triton(raw_kv: torch.Tensor, raw_gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                      kv: torch.Tensor, gate: torch.Tensor, rate: int) -> torch.Tensor:
    batch, dim = kv.shape
    ring = raw_kv.shape[1]
    out = torch.empty(batch, dim, dtype=torch.float32, device=kv.device)
    if batch:
        block = min(CHANNELS_PER_PROGRAM, triton.next_power_of_2(dim))
        _group_pool_kernel[(batch, triton.cdiv(dim, block))](
            raw_kv, raw_gate, kv.float().contiguous(), gate.float().contiguous(), slots, positions, out,
            slots.stride(0), positions.stride(0), ring, rate, dim, RATE=triton.next_power_of_2(rate), BLOCK=block,
        )
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["slot_stride", "position_stride"])
    def _group_pool_kernel(raw_kv, raw_gate, kv_new, gate_new, slots, positions, out, slot_stride, position_stride,
                           ring, rate, dim, RATE: tl.constexpr, BLOCK: tl.constexpr):
        """Program (sequence, channel block): the token's channels into the ring, a barrier, then the
        group's `rate` rows of those channels: softmax of gate over the rows, times kv, summed."""
        b = tl.program_id(0).to(tl.int64)
        channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = channel < dim
        slot = tl.load(slots + b * slot_stride).to(tl.int64)
        position = tl.load(positions + b * position_stride).to(tl.int64)
        base = slot * ring * dim
        here = base + (position % ring) * dim + channel
        tl.store(raw_kv + here, tl.load(kv_new + b * dim + channel, mask=inside, other=0.0), mask=inside)
        tl.store(raw_gate + here, tl.load(gate_new + b * dim + channel, mask=inside, other=0.0), mask=inside)
        tl.debug_barrier()  # the program's own ring stores land before its group is read back
        token = tl.arange(0, RATE)
        row = (position // rate * rate + token) % ring
        at = base + row[:, None] * dim + channel[None, :]
        valid = (token < rate)[:, None] & inside[None, :]
        g = tl.load(raw_gate + at, mask=valid, other=float("-inf"))  # padded tokens weigh nothing
        g = tl.where(inside[None, :], g, 0.0)  # channels past dim: finite, never stored
        weights = tl.exp(g - tl.max(g, axis=0)[None, :])
        weights = weights / tl.sum(weights, axis=0)[None, :]
        pooled = tl.sum(tl.load(raw_kv + at, mask=valid, other=0.0) * weights, axis=0)
        tl.store(out + b * dim + channel, pooled, mask=inside)
