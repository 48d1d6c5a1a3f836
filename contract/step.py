"""StepPlan / StepResult: the messages between the scheduler and the worker for one step.

Multi-token steps (speculative decoding): a chunk may carry draft tokens to verify after its tokens,
and a result may carry the drafts it accepted before the token it sampled, and the drafts the worker
proposes for the step after. The scheduler applies a result's tokens one by one, with the stop and length checks after
each; worker/runner.py's docstring says how a rejected draft would be rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.sampling import SamplingParams, TokenLogprob

# the input of a decode chunk planned while the step that draws it still runs (overlapped scheduling):
# the token this request's sampling chunk of the previous plan draws, which the worker takes from that
# step's draw on the device (only an executor with `pending_inputs` is given such chunks)
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    slot: int
    pages: tuple[int, ...]  # the sequence's block table (covers position + len(token_ids))
    token_ids: tuple[int, ...]  # a one-token decode chunk's may be (PENDING_TOKEN,)
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
    # tokens proposed to follow token_ids (a speculative step), computed after them and verified by
    # drawing at each: only a sampling chunk carries them (scheduler/scheduler.py sets them)
    draft_token_ids: tuple[int, ...] = ()
    # a sampling chunk: the worker's proposer drafts after it (False: the scheduler's draft policy has the
    # request's next chunk verify none, so the proposer only keeps its state: worker/proposers.py)
    draft_next: bool = True
    # the tokens this chunk's draw may take, one bit per token id (bit i % 32 of word i // 32, words
    # as int32 values), from the request's grammar (engine/structured_outputs.py); empty: any token
    token_bitmask: tuple[int, ...] = ()


@dataclass(frozen=True)
class StateCopy:
    """Copies one model-cache slot's fixed state (window rings, open groups, Engram look-back)."""

    source: int
    target: int


TIER_MOVES = ("spill", "write", "fetch", "load")  # in the order a plan's moves run (docs/prefix-tiers.md)


@dataclass(frozen=True)
class TierMove:
    """One prefix-cache state point copied between cache tiers (docs/prefix-tiers.md):
    spill gpu -> host, write host -> disk (asynchronous), fetch disk -> host (asynchronous), load host -> gpu.
    `slot` is (source, target) slot of the two tiers (a gpu slot is a model-cache slot: a snapshot slot, or
    a request's slot), `pages` the (source, target) pages the target tier lacks (host and disk tiers share
    full pages between points). Disk records are sealed: `seals` holds the slot record's seal, then each
    of `pages`' (a write seals them so, a fetch checks them). An asynchronous move reports `ticket` in a
    later StepResult.tier_done."""

    kind: str  # one of TIER_MOVES
    slot: tuple[int, int]
    pages: tuple[tuple[int, int], ...] = ()
    seals: tuple[int, ...] = ()
    ticket: int = 0


@dataclass(frozen=True)
class TierDone:
    """An asynchronous tier move finished: `error` None when every record was written, or read and verified."""

    ticket: int
    error: str | None = None
    # a failed fetch: the disk page records (the move's source pages) that did not verify; () when only
    # its slot record failed; None when that is not known (an I/O error, a failure on another rank)
    bad_pages: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepPlan:
    """The step's chunks, and the prefix cache's copies the worker makes before the forward, in this
    order: `tier_moves` of kinds spill, write and fetch (in that order), `saves` (a request's slot into
    a snapshot slot, for state points taken at the end of the previous step or at a preemption),
    `restores` (a snapshot into a request's slot, for hits), the `tier_moves` of kind load, then
    `page_copies` ((source, target) pages: a hit's partial last page, which the request writes on)."""

    chunks: tuple[ScheduledChunk, ...]
    saves: tuple[StateCopy, ...] = ()
    restores: tuple[StateCopy, ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()
    tier_moves: tuple[TierMove, ...] = ()
    # asynchronous tier moves still out (their TierDone not seen yet): a plan with no other work then
    # lets the worker wait briefly for completions instead of returning at once
    tickets_out: int = 0
    # seeds the step's unseeded draws, so that every tensor-parallel rank draws the same tokens (each
    # rank feeds its own draws to the next step's PENDING_TOKEN inputs)
    draw_seed: int = 0

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.saves or self.restores or self.page_copies or self.tier_moves
                    or self.tickets_out)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) + len(c.draft_token_ids) for c in self.chunks)


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk produced. Its new tokens are `accepted` then `sampled`: the verified prefix of
    the chunk's drafts (as many as were accepted, each with the logprob the model gave it), then the
    token drawn after them, which is the next step's input."""

    request_id: str
    sampled: TokenLogprob | None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # logprob of chunk token i+1 given tokens <= i
    error: str | None = None  # this chunk could not be computed correctly (e.g. an unreadable Engram row)
    accepted: tuple[TokenLogprob, ...] = ()  # a prefix of the chunk's draft_token_ids; empty without drafts
    # draft tokens the worker's proposer (speculative decoding) suggests to follow `sampled`: the
    # scheduler may send them back as the next chunk's draft_token_ids (fewer, or none, is always right)
    proposed: tuple[int, ...] = ()

    @property
    def new_tokens(self) -> tuple[TokenLogprob, ...]:
        """The chunk's output tokens in order (none for a prompt chunk or a failed one)."""
        return self.accepted + (self.sampled,) if self.sampled is not None else self.accepted


@dataclass(frozen=True)
class StepResult:
    chunks: tuple[ChunkResult, ...]
    tier_done: tuple[TierDone, ...] = ()  # asynchronous tier moves that finished since the last step
    # the worker's proposer (speculative decoding) after this step: sampling chunks it drafted after, and
    # those it skipped drafting after (`draft_next` False: it only kept its state)
    draft_steps: int = 0
    skipped_draft_steps: int = 0
