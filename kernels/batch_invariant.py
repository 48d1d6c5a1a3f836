"""Batch-invariant matrix products for deterministic mode (`runtime.deterministic`).

A GEMM library picks its blocking, vector paths and thread split from the matrix sizes, so the same
row multiplied by the same weight can round differently when 1 or 300 tokens share the step. Inside
`BatchInvariantMode`, every `mm` / `addmm` / `bmm` runs in fixed tiles of TILE_ROWS rows (the last tile
zero-padded), so each row always meets the kernel in the same shape and its result depends only on
its own values. Transcendental elementwise ops have the same problem in a smaller way: the CPU kernel
runs whole vectors through a SIMD approximation and the leftover tail through the scalar one, which
can differ in the last bit, and which elements fall in the tail depends on the tensor's size. They
run here over a zero-padded flat copy in fixed chunks of ELEMENTWISE_CHUNK elements, so every element
takes the vector path. The attention layers check `batch_invariant_active()` and then attend query by query
over exactly that query's keys (models/), which fixes the order of the softmax reductions too.
This is the torch reference path; it costs speed (see bench/decode.py --deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

TILE_ROWS = 16
ELEMENTWISE_CHUNK = 4096  # a multiple of every SIMD width, below torch's parallel grain (one thread each)
aten = torch.ops.aten
_TRANSCENDENTAL = {
    aten.sigmoid.default, aten.exp.default, aten.exp2.default, aten.expm1.default, aten.log.default,
    aten.log1p.default, aten.log2.default, aten.tanh.default, aten.rsqrt.default, aten.sqrt.default,
    aten.silu.default, aten.softplus.default, aten.erf.default, aten.sin.default, aten.cos.default,
    aten.pow.Tensor_Scalar, aten.gelu.default,
}


def _tiled_rows(mm, a: torch.Tensor, b: torch.Tensor, row_dim: int) -> torch.Tensor:
    rows = a.shape[row_dim]
    pad = (-rows) % TILE_ROWS
    if pad:
        widths = [0, 0] * (a.dim() - 1 - row_dim) + [0, pad]
        a = F.pad(a, widths)
    tiles = [mm(tile, b) for tile in a.split(TILE_ROWS, dim=row_dim)]
    return torch.cat(tiles, dim=row_dim).narrow(row_dim, 0, rows)


def _fixed_chunks(func, x: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor:
    flat = x.contiguous().view(-1)
    count = flat.numel()
    flat = F.pad(flat, (0, (-count) % ELEMENTWISE_CHUNK))
    out = torch.cat([func(piece, *rest, **kwargs) for piece in flat.split(ELEMENTWISE_CHUNK)])
    return out[:count].view(x.shape)


class BatchInvariantMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and not kwargs:
            return _tiled_rows(func, args[0], args[1], row_dim=0)
        if func is aten.bmm.default and not kwargs:
            return _tiled_rows(func, args[0], args[1], row_dim=1)
        if func in (aten.einsum.default, aten.matmul.default):  # kept whole under inference_mode
            with self:  # decompose into mm / bmm that come back through this mode
                return func.decompose(*args, **kwargs)
        if func is aten.linear.default:  # not decomposed under inference_mode either
            x, weight, bias = args[0], args[1], (args[2] if len(args) > 2 else kwargs.get("bias"))
            rows = x.reshape(-1, x.shape[-1])
            out = _tiled_rows(aten.mm.default, rows, weight.t(), row_dim=0).view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
        if func is aten.addmm.default and not kwargs:
            bias, a, b = args
            return _tiled_rows(aten.mm.default, a, b, row_dim=0) + bias
        if func in _TRANSCENDENTAL and args[0].is_floating_point() and args[0].numel() > 0:
            return _fixed_chunks(func, args[0], tuple(args[1:]), kwargs)
        return func(*args, **kwargs)


def batch_invariant_active() -> bool:
    return any(isinstance(mode, BatchInvariantMode) for mode in _get_current_dispatch_mode_stack())


def attend_one_query(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One query's attention with K = V: q [heads, d], keys [n, d] (exactly its visible keys, in a fixed
    order), sinks [heads] as an extra softmax column -> [heads, d]."""
    logits = torch.cat([q @ keys.t() * scale, sinks.to(q.dtype)[:, None]], dim=1)
    probs = torch.softmax(logits - logits.max(dim=1, keepdim=True).values, dim=1)[:, :-1]
    return probs.to(keys.dtype) @ keys
