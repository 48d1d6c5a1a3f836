"""The measured half of memory admission: weight bytes, the budget, and the profiling step.

After the weights are loaded, one profiling step runs at the largest batch the config allows (a
prefill chunk of `max_num_batched_tokens`, decode tokens for the other sequences, every logits row
kept, sampling with 20 logprobs); its peak is the workspace. engine/admission.py turns the figures
into a page count. The budget is `gpu_memory_utilization` of the device on a GPU and `host_memory_gb`
on the CPU (where the cache lives in host memory).
"""

from __future__ import annotations

import resource

import torch

from contract import SamplingParams, ScheduledChunk, StepPlan

GiB = 2**30


def model_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    memory = model.engram_memory
    engram = memory.resident_bytes() if memory is not None else 0
    return engram + sum(t.numel() * t.element_size() for t in tensors)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def profile_workspace(runner, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Peak bytes one largest step needs beyond its persistent buffers (runs it on the runner's cache)."""
    vocab = runner.model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, prompt_logprobs=20, seed=0)
    block = runner.cache.block_tokens
    prefill = max(1, max_num_batched_tokens - (max_num_seqs - 1))
    chunks, next_page = [], 0
    for slot in range(max_num_seqs):
        length = prefill if slot == 0 else 1
        pages = tuple(range(next_page, next_page + -(-length // block)))
        next_page += len(pages)
        tokens = tuple((7 * i + slot) % vocab for i in range(length))
        chunks.append(ScheduledChunk(
            request_id=f"profile-{slot}", slot=slot, pages=pages, token_ids=tokens, position=0, sample=True,
            logprob_targets=tokens[1:], params=params, num_generated=0,
        ))
    plan = StepPlan(chunks=tuple(chunks))
    if runner.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner.execute(plan)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    before = _peak_rss_bytes()
    runner.execute(plan)
    return max(0, _peak_rss_bytes() - before)


def profile_pages(max_num_seqs: int, max_num_batched_tokens: int, block_tokens: int) -> int:
    """Pages the profiling step itself writes into."""
    return -(-max_num_batched_tokens // block_tokens) + max_num_seqs


def budget_bytes(device: str, gpu_memory_utilization: float, host_memory_gb: float) -> int:
    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory * gpu_memory_utilization)
    return int(host_memory_gb * GiB)


