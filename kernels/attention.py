"""Decode attention of DeepSeek-V4: one query per sequence over its gathered keys (K = V), with a
learned per-head sink logit that takes probability mass but adds no value.

Keys are [B, K, D]: the sliding-window ring's rows, then the compressed entries the layer reads (CSA:
the indexer's top-k; HCA: every entry the block table holds), and `valid` [B, K] masks rows that hold
no visible position. `decode_attention_reference` is the torch definition (the CPU path and the
oracle); on the GPU `decode_attention` runs one Triton program per (sequence, 16 heads): an online
softmax over blocks of keys that starts from the sink (so a row with no valid key yields zeros, never
NaN), float32 throughout, in place of the ~10 kernels of the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK_HEADS = 16
BLOCK_KEYS = 32


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


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    head_dim = q.shape[-1]
    half = q.dtype in (torch.bfloat16, torch.float16)  # float32 would run tl.dot in TF32
    if triton is None or not q.is_cuda or not half or head_dim & (head_dim - 1) or head_dim < 16:
        return decode_attention_reference(q, keys, valid, sinks, scale)
    return decode_attention_triton(q, keys, valid, sinks, scale)


def decode_attention_triton(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    q, keys = q.contiguous(), keys.contiguous()
    valid = valid.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    grid = (batch, triton.cdiv(heads, BLOCK_HEADS))
    _decode_attention_kernel[grid](
        q, keys, valid, sinks.float().contiguous(), out, scale, heads, keys.shape[1],
        D=head_dim, BLOCK_H=BLOCK_HEADS, BLOCK_K=BLOCK_KEYS, num_warps=8,
    )
    return out


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, keys_ptr, valid_ptr, sinks_ptr, out_ptr, scale, heads, n_keys,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        sequence = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_heads = head < heads
        dim = tl.arange(0, D)
        q_rows = q_ptr + sequence * heads * D + head[:, None] * D + dim[None, :]
        q = tl.load(q_rows, mask=in_heads[:, None], other=0.0)
        # the softmax starts from the sink: running max = sink, running sum = exp(0) = 1, no value
        running_max = tl.load(sinks_ptr + head, mask=in_heads, other=0.0)
        running_sum = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
        keys_base = keys_ptr + sequence * n_keys * D
        for start in range(0, n_keys, BLOCK_K):
            key = start + tl.arange(0, BLOCK_K)
            in_keys = key < n_keys
            usable = (tl.load(valid_ptr + sequence * n_keys + key, mask=in_keys, other=0) != 0) & in_keys
            block = tl.load(keys_base + key[:, None] * D + dim[None, :], mask=usable[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(block)) * scale  # [BLOCK_H, BLOCK_K] float32
            scores = tl.where(usable[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(block.dtype), block)
            running_max = new_max
        out = acc / running_sum[:, None]
        out_rows = out_ptr + sequence * heads * D + head[:, None] * D + dim[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=in_heads[:, None])
