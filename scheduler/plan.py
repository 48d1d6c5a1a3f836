"""StepPlan / StepResult: the messages between the scheduler and the worker for one step."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    slot: int
    pages: tuple[int, ...]  # the sequence's block table (covers position + len(token_ids))
    token_ids: tuple[int, ...]
    position: int  # tokens of this sequence already in the cache
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    # echo: the prompt tokens that follow each chunk row (row i predicts logprob_targets[i]); empty if not asked
    logprob_targets: tuple[int, ...]
    params: SamplingParams
    num_generated: int  # output tokens so far (seeds the per-request sampler deterministically)
    # filled only when the request's params need the token history (penalties), so plain requests do
    # not copy histories every step
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class ChunkResult:
    request_id: str
    sampled: TokenLogprob | None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # logprob of chunk token i+1 given tokens <= i
    error: str | None = None  # this chunk could not be computed correctly (e.g. an unreadable Engram row)


@dataclass(frozen=True)
class StepResult:
    chunks: tuple[ChunkResult, ...]
