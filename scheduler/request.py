"""A request's mutable state inside the scheduler (the message that created it is contract.NewRequest)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract import NewRequest, SamplingParams

if TYPE_CHECKING:
    from scheduler.prefix_cache import StatePoint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Request:
    """One admitted request: the frozen message it came in, and what the scheduler has done with it."""

    message: NewRequest
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of prompt + output already in the cache
    slot: int | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the first admission found in the prefix cache
    logits_position: int = -1  # computed tokens when the slot's last logits were produced
    # time.monotonic() of its arrival and first scheduling: its outputs report queue and inference
    # times from these, as durations
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    # overlapped scheduling: chunks launched whose results are not applied yet (`num_computed_tokens`
    # counts their tokens already), of them the sampling ones, whose tokens are still on the device,
    # and the state points taken for them (position, point), confirmed when their chunk lands
    chunks_in_flight: int = 0
    draws_in_flight: int = 0
    unconfirmed: list[tuple[int, StatePoint]] = field(default_factory=list)
    # speculative decoding: the drafts the worker proposed to follow the last token (its last landed
    # result's `proposed`); the next decode chunk verifies as many as fit
    drafts: tuple[int, ...] = ()
    # the draft policy asked for those drafts as a probe (spec_policy.Drafting.PROBE): one is verified
    probing: bool = False

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.message.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.message.params

    @property
    def cache_salt(self) -> str | None:
        return self.message.cache_salt

    @property
    def cache_boundary(self) -> int | None:
        return self.message.cache_boundary

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.message.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        """The sequence as its next chunk sees it: the known tokens, then the draws still in flight."""
        return len(self.message.prompt_token_ids) + len(self.output_token_ids) + self.draws_in_flight

    @property
    def reads_own_tokens(self) -> bool:
        """Its draws need its previous token on the host (penalties and multi-id bad words read the
        history; a grammar's bitmask follows the matcher; echo collects per chunk), so its next chunk
        waits until the one in flight landed."""
        params = self.params
        return params.penalizes_output or params.structured is not None or params.prompt_logprobs is not None

    @property
    def takes_drafts(self) -> bool:
        """Whether its next chunk may verify drafts, the draws in flight counted as landed: not under a
        grammar (its bitmask constrains a chunk's first draw only: engine/structured_outputs.py), nor while
        min_tokens holds eos back (the sampler bans it at a chunk's first draw, not at the positions after
        its drafts). Exact for the chunk after those in flight: a chunk carrying drafts was past min_tokens
        already, and the drafts it accepts only keep it past."""
        params = self.params
        return params.structured is None and len(self.output_token_ids) + self.draws_in_flight >= params.min_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < len(self.message.prompt_token_ids)
