"""Decode attention of DeepSeek-V4: one query per sequence over its gathered keys (K = V), with a
learned per-head sink logit that takes probability mass but adds no value.

Keys are [B, K, D]: the sliding-window ring's rows, then the compressed entries the layer reads (CSA:
the indexer's top-k; HCA: every entry the block table holds), and `valid` [B, K] masks rows that hold
no visible position. `decode_attention_reference` is the torch definition (the CPU path and the
oracle); on the GPU `decode_attention` runs two Triton kernels in place of the ~10 of the torch path:
an online softmax per (sequence, 16 heads, 64 keys), float32 throughout, then a merge of the splits
that adds the sink (so a row with no valid key yields zeros, never NaN).
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
KEYS_PER_SPLIT = 64


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
        sequence = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        in_heads = head < heads
        dim = tl.arange(0, D)
        q = tl.load(q_ptr + sequence * heads * D + head[:, None] * D + dim[None, :], mask=in_heads[:, None], other=0.0)
        # a split with no valid key keeps max -inf, sum 0, values 0 (the merge weighs it by 0)
        running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
        keys_base = keys_ptr + sequence * n_keys * D
        for offset in range(0, KEYS_PER_SPLIT, BLOCK_K):
            key = split * KEYS_PER_SPLIT + offset + tl.arange(0, BLOCK_K)
            in_keys = key < n_keys
            usable = (tl.load(valid_ptr + sequence * n_keys + key, mask=in_keys, other=0) != 0) & in_keys
            block = tl.load(keys_base + key[:, None] * D + dim[None, :], mask=usable[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(block)) * scale  # [BLOCK_H, BLOCK_K] float32
            scores = tl.where(usable[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - safe_max)
            probs = tl.exp(scores - safe_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(block.dtype), block)
            running_max = new_max
        part = (sequence * heads + head) * splits + split
        tl.store(max_ptr + part, running_max, mask=in_heads)
        tl.store(sum_ptr + part, running_sum, mask=in_heads)
        tl.store(acc_ptr + part[:, None] * D + dim[None, :], acc, mask=in_heads[:, None])

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
