"""The ceilings and the counts that bench/slice.py divides by.

Ceilings are measured in the same run as the figures they judge (METHOD.md: datasheet rates are only
leads): a device-to-device copy of a large buffer, counting bytes read plus bytes written, and a large
bf16 matrix product on random data. Counts are the fewest bytes a decode step must read (the weights
it touches and the KV it attends to) and the useful FLOPs of a prefill (masked-out scores not counted).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from models.config import CSA, HCA, ModelConfig


def timed_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> list[float]:
    """Milliseconds of each of `repeats` calls after `warmup` ones: CUDA events on a GPU, the host
    clock on the CPU (whose work is synchronous)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - begin))
    return out


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> dict:
    """Bytes/s of a device-to-device copy, read + written, median of `repeats`."""
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = statistics.median(timed_ms(lambda: target.copy_(source), device, repeats))
    return {"bench": "slice.copy", "bytes": nbytes, "ms_p50": ms, "bytes_per_s": 2 * nbytes / (ms / 1000)}


def matmul_ceiling(device: str, n: int, dtype: torch.dtype, repeats: int = 10) -> dict:
    """FLOP/s of an n x n x n matrix product on random data (never zeros: they run faster)."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    ms = statistics.median(timed_ms(lambda: a @ b, device, repeats, warmup=3))
    return {"bench": "slice.matmul", "n": n, "dtype": str(dtype).removeprefix("torch."), "ms_p50": ms,
            "flops_per_s": 2 * n**3 / (ms / 1000)}


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def weight_bytes_read(model: torch.nn.Module, experts_touched: Sequence[int], tokens: int) -> int:
    """Weight bytes one step of `tokens` tokens reads: every dense parameter once, the routed experts
    it touched (`experts_touched[layer]` of them), and one embedding / hash-table row per token."""
    total = 0
    for name, tensor in _named_tensors(model):
        nbytes = tensor.numel() * tensor.element_size()
        if ".mlp.experts." in name:
            total += nbytes * experts_touched[int(name.split(".")[2])] // tensor.shape[0]
        elif name.endswith(("embed_tokens.weight", "tid2eid")):
            total += nbytes * min(tokens, tensor.shape[0]) // tensor.shape[0]
        else:
            total += nbytes
    return total


def active_params_per_token(model: torch.nn.Module) -> int:
    """Parameters one token multiplies by: dense ones, its top-k experts, the vocabulary head (the
    embedding row and hash rows are lookups, not products)."""
    config, total = model.config, 0
    for name, tensor in _named_tensors(model):
        if ".mlp.experts." in name:
            total += tensor.numel() * config.num_experts_per_tok // tensor.shape[0]
        elif tensor.is_floating_point() and not name.endswith("embed_tokens.weight"):
            total += tensor.numel()
    return total


def kv_bytes_read(config: ModelConfig, contexts: Sequence[int], elem_bytes: int) -> int:
    """Cache bytes the decode tokens of sequences at these lengths read: the sliding window; on CSA
    layers the indexer keys of every entry plus the top-k entries it selects; on HCA layers every
    entry. The compressors' open-window rings (kilobytes) are left out."""
    total = 0
    for length in contexts:
        for kind, rate in zip(config.layer_types, config.compress_rates):
            total += min(length, config.sliding_window) * config.head_dim
            entries = length // rate if rate else 0
            if kind == CSA:
                total += entries * config.index_head_dim + min(entries, config.index_topk) * config.head_dim
            elif kind == HCA:
                total += entries * config.head_dim
    return total * elem_bytes


def prefill_flops(model: torch.nn.Module, prompt_len: int) -> float:
    """Useful FLOPs of a prompt's prefill: 2 per active parameter per token (the head on the last
    token only), plus attention (QK and PV over each query's visible keys) and the indexer's scoring."""
    c = model.config
    head = model.lm_head.weight.numel()
    flops = 2.0 * (active_params_per_token(model) - head) * prompt_len + 2.0 * head
    seen = torch.arange(1, prompt_len + 1, dtype=torch.float64)  # tokens each query has seen
    for kind, rate in zip(c.layer_types, c.compress_rates):
        keys = seen.clamp(max=c.sliding_window)
        if kind == CSA:
            entries = torch.div(seen, rate, rounding_mode="floor")
            keys = keys + entries.clamp(max=c.index_topk)
            flops += 2.0 * c.index_n_heads * c.index_head_dim * entries.sum().item()
        elif kind == HCA:
            keys = keys + torch.div(seen, rate, rounding_mode="floor")
        flops += 4.0 * c.num_heads * c.head_dim * keys.sum().item()
    return flops
