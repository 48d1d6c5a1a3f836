"""The engine's limits and the checks a request must pass against them.

Pure, so the front end runs them before it sends a request (a 400 without a round trip) and the
engine runs the same code on what arrives; the engine announces its limits in EngineReady.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.requests import NewRequest
from contract.sampling import InvalidSamplingParams


@dataclass(frozen=True)
class PrefixTierLimits:
    """The prefix cache's tiers below the GPU (docs/prefix-tiers.md), in the units the scheduler hands
    out: slots (one state point's fixed state each) and pages (one KV page of every paged layer each).
    All zero: no host tier (no disk tier either: the disk tier is written through the host tier)."""

    host_slots: int = 0
    host_pages: int = 0
    disk_slots: int = 0
    disk_pages: int = 0

    @property
    def host(self) -> bool:
        return self.host_slots > 0 and self.host_pages > 0

    @property
    def disk(self) -> bool:
        return self.host and self.disk_slots > 0 and self.disk_pages > 0


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_pages: int | None = None  # KV pages the memory plan affords (None: enough for every slot)
    block_tokens: int = 128
    # prefix-cache snapshot slots, model-cache slots max_num_seqs .. max_num_seqs + this - 1 (0: no cache)
    prefix_snapshots: int = 0
    prefix_tiers: PrefixTierLimits = PrefixTierLimits()

    @property
    def total_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return -(-self.max_model_len // self.block_tokens) * self.max_num_seqs


class RequestRejected(ValueError):
    """A request the engine will not run; the message is meant for the client (HTTP 400), `param`
    names the request field at fault where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate_request(limits: EngineLimits, request: NewRequest) -> None:
    """Raises RequestRejected for a request the engine would refuse; pure, so the front end runs it too."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestRejected("the prompt is empty", "prompt")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})", "prompt")
    if len(prompt) + request.params.max_tokens > limits.max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {limits.max_model_len} tokens; the request has "
            f"{len(prompt)} prompt tokens and asks for {request.params.max_tokens} more"
        )
    try:
        request.params.validate(limits.vocab_size)
    except InvalidSamplingParams as exc:
        raise RequestRejected(str(exc), exc.param) from exc
    capacity = limits.total_pages * limits.block_tokens
    if len(prompt) + request.params.max_tokens > capacity:
        raise RequestRejected(
            f"the request needs {len(prompt) + request.params.max_tokens} tokens of KV cache; this server's "
            f"cache holds {capacity}"
        )
