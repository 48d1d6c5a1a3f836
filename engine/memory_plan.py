"""The measured half of memory admission: weight bytes, the budget, and the profiling step.

After the weights are loaded, one profiling step runs at the largest batch the config allows (a
prefill chunk of `max_num_batched_tokens`, decode tokens for the other sequences, every logits row
kept, sampling with 20 logprobs); its peak is the workspace. engine/admission.py turns the figures
into a page count. The budget is `gpu_memory_utilization` of the device on a GPU and `host_memory_gb`
on the CPU (where the cache lives in host memory).

The prefix cache's tiers below the GPU (docs/prefix-tiers.md) are budgeted here too, in records: a slot
record (one state point's fixed state and its last-logits row) and a page record (one KV page of every
paged layer), their bytes read off the engine's cache layout (`record_layout`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from contract import SamplingParams, ScheduledChunk, StepPlan
from contract.config import PrefixCacheSection
from contract.limits import PrefixTierLimits
from engine.admission import MemoryPlanError
from engram_store.format import PAGE
from models.cache import ModelCache
from worker.prefix_tiers import disk_record_pages, page_record_bytes, slot_record_bytes

GiB = 2**30
# Slots get this share of a tier's bytes (at least one slot), pages the rest. A point costs one slot plus
# the pages it does not share: a chat's newest points (its last boundary and finish) share all of its
# pages, so a long chat asks mostly for pages (V4-Flash, 64K tokens: 3 slots of 11.7 MB against 512
# pages of 0.88 MB, 7% slots) and a short one mostly for slots (4K tokens: 3 slots against 32 pages,
# 55%). A quarter sits between; V4-Flash then keeps ~40 pages (5K tokens) per slot.
SLOT_SHARE = 0.25


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters, buffers and the Engram memory's tables, row caches and the caches' device indexes."""
    tensors = list(model.parameters()) + list(model.buffers())
    memory = model.engram_memory
    engram = memory.resident_bytes() if memory is not None else 0
    return engram + sum(t.numel() * t.element_size() for t in tensors)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def profile_plan(vocab: int, block: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None) -> StepPlan:
    """The largest step the config allows: a prefill chunk of `max_num_batched_tokens` less a decode
    token for each other sequence, every logits row kept, sampling with 20 logprobs. The prefill chunk
    is the last one of a `max_model_len` prompt: there its attention reads the most compressed entries
    a chunk can (HCA's every entry, the indexer's scores and top-k over all of them), workspace a chunk
    at position 0 never shows. Its block table repeats the chunk's own pages for the positions before
    it: the step is run for its memory, whatever those pages hold."""
    params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, prompt_logprobs=20, seed=0)
    prefill = max(1, max_num_batched_tokens - (max_num_seqs - 1))
    deepest = max(0, (max_model_len or prefill) - prefill)
    chunks, next_page = [], 0
    for slot in range(max_num_seqs):
        length = prefill if slot == 0 else 1
        position = deepest if slot == 0 else 0
        own = -(-length // block) + (1 if position % block else 0)  # the pages the chunk's tokens land in
        pages = tuple(next_page + j % own for j in range(-(-(position + length) // block)))
        next_page += own
        tokens = tuple((7 * i + slot) % vocab for i in range(length))
        chunks.append(ScheduledChunk(
            request_id=f"profile-{slot}", slot=slot, pages=pages, token_ids=tokens, position=position, sample=True,
            logprob_targets=tokens[1:], params=params, num_generated=0,
        ))
    return StepPlan(chunks=tuple(chunks))


def profile_workspace(runner, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None) -> int:
    """Peak bytes `profile_plan`'s step needs beyond the runner's persistent buffers (run on its cache)."""
    plan = profile_plan(runner.model.config.vocab_size, runner.cache.block_tokens, max_num_seqs,
                        max_num_batched_tokens, max_model_len)
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
    """Pages the profiling step itself writes into (its prefill chunk may straddle one more page)."""
    return -(-max_num_batched_tokens // block_tokens) + 1 + max_num_seqs


def budget_bytes(device: str, gpu_memory_utilization: float, host_memory_gb: float) -> int:
    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory * gpu_memory_utilization)
    return int(host_memory_gb * GiB)




@dataclass(frozen=True)
class RecordLayout:
    """One rank's records of the prefix cache's tiers (worker/prefix_tiers.py lays them out): their bytes
    and what they hold, in order (each fixed tensor's row, the last-logits row when the runner keeps one,
    then each paged tensor's page: what a record's bytes mean, for the disk catalog's fingerprint)."""

    slot_bytes: int  # one state point's fixed state and last-logits row
    page_bytes: int  # one page of every paged layer (the KV host tier's part included)
    tensors: tuple[str, ...]  # "slot|page [row shape] dtype" per tensor, in record order

    @property
    def disk_slot_bytes(self) -> int:
        return disk_record_pages(self.slot_bytes) * PAGE

    @property
    def disk_page_bytes(self) -> int:
        return disk_record_pages(self.page_bytes) * PAGE


def record_layout(cache: ModelCache, vocab_size: int | None) -> RecordLayout:
    """The records of `cache`'s layout (a live cache or one on the meta device: only shapes count);
    `vocab_size` when the runner keeps last logits (it does with prefix-cache snapshot slots)."""
    rows = [("slot", t) for t in cache.fixed_tensors()] + [("page", t) for t in cache.paged_tensors()]
    tensors = [f"{kind} {list(t.shape[1:])} {str(t.dtype).removeprefix('torch.')}" for kind, t in rows]
    if vocab_size:
        tensors.insert(len(cache.fixed_tensors()), f"slot [{vocab_size}] float32")
    return RecordLayout(slot_record_bytes(cache, vocab_size), page_record_bytes(cache), tuple(tensors))


def split_tier(budget: int, slot_bytes: int, page_bytes: int, key: str) -> tuple[int, int]:
    """(slots, pages) one tier's `budget` bytes hold (SLOT_SHARE); (0, 0) for a tier that is off.
    Raises MemoryPlanError, naming `key`, for a budget below one slot and one page."""
    if budget <= 0:
        return 0, 0
    slots = max(1, int(budget * SLOT_SHARE) // slot_bytes)
    pages = (budget - slots * slot_bytes) // page_bytes
    if pages < 1:
        raise MemoryPlanError(
            f"{key}: {budget:,} B per rank hold no state point: one needs a slot record of {slot_bytes:,} B and"
            f" at least one page record of {page_bytes:,} B; raise it or set it to 0 (off)"
        )
    return slots, pages


def prefix_tier_limits(section: PrefixCacheSection, ranks: int, layout: RecordLayout) -> PrefixTierLimits:
    """Each rank's share of the tiers' budgets, in records (every rank keeps its own copy of each point)."""
    host_slots, host_pages = split_tier(int(section.host_gb * GiB) // ranks, layout.slot_bytes, layout.page_bytes,
                                        "prefix_cache.host_gb")
    disk_slots, disk_pages = split_tier(int(section.disk_gb * GiB) // ranks, layout.disk_slot_bytes,
                                        layout.disk_page_bytes, "prefix_cache.disk_gb")
    return PrefixTierLimits(host_slots, host_pages, disk_slots, disk_pages)
