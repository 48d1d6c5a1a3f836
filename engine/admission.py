"""Memory admission arithmetic: how many KV pages the engine can afford (pure Python).

    pages = (budget - weights - workspace - fixed per-slot state) / bytes per page

capped at what `max_num_seqs` sequences of `max_model_len` tokens can use, or `memory.num_kv_pages`
when the config pins it. With the KV host tier on a GPU (`offload.kv: host_packed`), the part of each
page that lives in host RAM is budgeted there (`memory.host_memory_gb`) instead, and the pages are
the fewer of what either memory affords. The figures are measured by the worker (engine/memory_plan.py) after the
weights are loaded and one largest step has run.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


class MemoryPlanError(ValueError):
    """The configuration cannot fit; the message says what to change."""


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    budget_bytes: int
    weights_bytes: int
    workspace_bytes: int
    slot_state_bytes: int  # windows, open groups, look-back of every slot
    page_bytes: int  # per page, in the budgeted memory
    block_tokens: int
    num_pages: int
    pinned: bool  # num_pages came from memory.num_kv_pages
    host_tier_page_bytes: int = 0  # per page, in the KV host tier (on the CPU also inside page_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        tier = ""
        if self.host_tier_page_bytes:
            tier = (f"; host tier {self.host_tier_page_bytes} B per page, {self.host_tier_page_bytes / self.block_tokens:.0f}"
                    f" B per token, {self.num_pages * self.host_tier_page_bytes / GiB:.3f} GiB"
                    f"{' of it' if self.device != 'cuda' else ' of host RAM'}")
        return (
            f"memory plan ({self.device}): budget {self.budget_bytes / GiB:.2f} GiB = weights {self.weights_bytes / GiB:.3f}"
            f" + workspace {self.workspace_bytes / GiB:.3f} + slot state {self.slot_state_bytes / GiB:.3f}"
            f" + KV {self.num_pages} pages x {self.page_bytes} B ({self.kv_bytes / GiB:.3f} GiB, {self.block_tokens} tokens"
            f" per page, {self.page_bytes / self.block_tokens:.0f} B per token{tier}"
            f"{', pinned by memory.num_kv_pages' if self.pinned else ''})"
        )


def plan_pages(
    *,
    device: str,
    budget: int,
    weights: int,
    workspace: int,
    slot_state: int,
    page_bytes: int,
    block_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    pinned_pages: int | None,
    host_tier_page_bytes: int = 0,
    host_budget: int = 0,
) -> MemoryPlan:
    """`page_bytes` counts every tier; `host_tier_page_bytes` is the host tier's part of it."""
    host_tier = host_tier_page_bytes if device.startswith("cuda") else 0  # on the CPU it is the same memory
    page_bytes, block = max(1, page_bytes - host_tier), block_tokens
    per_sequence = -(-max_model_len // block)
    if pinned_pages is not None:
        pages, pinned = pinned_pages, True
    else:
        affordable = (budget - weights - workspace - slot_state) // page_bytes
        if host_tier:
            affordable = min(affordable, host_budget // host_tier)
        pages, pinned = min(affordable, per_sequence * max_num_seqs), False
    plan = MemoryPlan(device, budget, weights, workspace, slot_state, page_bytes, block, int(pages), pinned,
                      host_tier_page_bytes)
    if pages < per_sequence:
        raise MemoryPlanError(
            f"{plan.describe()}: one sequence of model.max_model_len={max_model_len} tokens needs {per_sequence} pages;"
            " lower model.max_model_len or scheduler.max_num_seqs, or raise the memory budget"
            " (memory.gpu_memory_utilization / memory.host_memory_gb)"
        )
    return plan
