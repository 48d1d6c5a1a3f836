"""Continuous batching policy: which requests run which tokens in the next step.

Pure Python over ids and integers (no torch). Every step takes one decode token from each running
request whose prompt is done, then prompt chunks of partly prefilled requests, then admits waiting
requests while cache slots, pages and the step's token budget last; long prompts are prefilled in
chunks. When a running request needs a page and none is left, the newest running request not yet
scheduled in this step is preempted: its pages and slot are released and it goes back to the front
of the queue, to be recomputed from its tokens later (its outputs so far are kept).

With the prefix cache on (scheduler/prefix_cache.py), an admitted request resumes from the longest
state point its tokens start with, and the scheduler takes points after prompt chunks, at the
request's cache boundary (a prompt chunk ends there), at preemption and at the end of a request.
The copies this needs (slot snapshots, a partial page) ride in the next StepPlan.

With the host tier on (scheduler/prefix_tiers.py, docs/prefix-tiers.md), a point the GPU evicts is
spilled into it (and written through to the disk tier), and admission takes the longest hit across the
tiers: a host hit is loaded into the request's slot and pages; a disk hit is fetched into the host tier
first, while the request waits and the requests behind it are admitted past it. As the engine stops,
`flush` puts the GPU's points on the disk tier too, so a restart finds the conversations that were
never evicted.

Overlapped scheduling (docs/overlap.md): the engine may plan step N+1 while step N runs, before its
results are applied. A chunk's tokens count as computed as it is scheduled; a decode whose input is
step N's draw (still on the device) gets PENDING_TOKEN, which the worker resolves, when the executor
takes such inputs (`pending_inputs`) and the request's draws need nothing on the host
(`Request.reads_own_tokens`; otherwise its next chunk waits a step). A state point is taken as its
chunk is scheduled (its snapshot copy rides in the next plan, which runs after it) and confirmed when
the chunk lands. A request whose draw in flight is its last (max_tokens) is not scheduled again; one
that stops on a token while its next chunk runs keeps its slot and pages until that chunk lands
(`draining`), and its end point is taken there, past the stop token. With no step in flight (the
serial loop) all of this reduces to schedule -> execute -> update as before.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from contract import (
    PENDING_TOKEN,
    EngineLimits,
    NewRequest,
    RequestOutput,
    ScheduledChunk,
    SpecDecodeCounts,
    StateCopy,
    StepPlan,
    StepResult,
    TierDone,
    TierMove,
    TokenLogprob,
    validate_request,
)
from scheduler.block_manager import BlockManager, BlockStats
from scheduler.prefix_cache import PrefixCache, StatePoint, block_chain
from scheduler.prefix_tiers import DiskEntry, PrefixTiers, TierPoint
from scheduler.request import Request, RequestStatus
from scheduler.spec_policy import Drafting, SpeculationPolicy

log = logging.getLogger("ds4serve.scheduler")

TIER_RANK = {"gpu": 0, "host": 1, "disk": 2}  # equally long hits: the nearest tier wins
# a block table no request has: it holds this plan's page-copy sources, so a page an eviction frees
# later in the same schedule is not handed to a load, which runs before the page copies
COPY_SOURCES = "\x00page-copy-sources"


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    preemptions: int  # since start
    last_step_tokens: int
    blocks: BlockStats
    prefix_queried_tokens: int = 0  # since start
    prefix_hit_tokens: int = 0
    prefix_points: int = 0
    host_points: int = 0  # the prefix cache's host and disk tiers (docs/prefix-tiers.md)
    disk_points: int = 0
    host_hit_tokens: int = 0  # of prefix_hit_tokens, those loaded from host (since start)
    disk_hit_tokens: int = 0  # and those fetched from disk first
    fetch_failures: int = 0  # fetches that failed verification or the read (the request recomputed)
    spec: SpecDecodeCounts = SpecDecodeCounts()  # since start



@dataclass(frozen=True)
class Hit:
    """The longest state point a request's tokens start with, in one tier."""

    tier: str  # "gpu", "host" or "disk"
    point: StatePoint | TierPoint
    position: int


class Scheduler:
    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.blocks = BlockManager(limits.total_pages, limits.block_tokens, limits.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.num_preemptions = 0
        self.last_step_tokens = 0
        self.spec = SpecDecodeCounts()
        # how many of the proposed drafts a decode chunk verifies (None: all of them, vLLM's fixed K)
        self.spec_policy: SpeculationPolicy | None = SpeculationPolicy.fresh()
        self.prefix: PrefixCache | None = None
        if limits.prefix_snapshots:
            snapshots = list(range(limits.max_num_seqs, limits.max_num_seqs + limits.prefix_snapshots))
            self.prefix = PrefixCache(snapshots, limits.block_tokens, self.blocks)
            self.blocks.evict = self.prefix.evict_one
        self.tiers: PrefixTiers | None = None
        if self.prefix is not None and limits.prefix_tiers.host:
            self.tiers = PrefixTiers(limits.prefix_tiers, limits.block_tokens)
            self.prefix.on_evict = self._spill
        self._saves: list[StateCopy] = []  # taken since the last plan; the worker copies them first
        self._fetching: dict[str, int] = {}  # waiting request -> the ticket of the fetch it waits for
        self._scanned: set[str] = set()  # waiting requests already looked up for a disk hit
        self._fetched: set[str] = set()  # waiting requests whose fetch finished: their host hit came from disk
        self._flushing: deque[StatePoint] | None = None  # GPU points the stopping engine still puts on disk
        self.host_hit_tokens = self.disk_hit_tokens = 0
        # decode chunks may take a draw still in flight as their input (PENDING_TOKEN): the engine sets
        # this when it overlaps steps and its executor resolves such inputs
        self.pending_inputs = False
        self.launched: dict[str, Request] = {}  # requests with chunks in flight (running, preempted or draining)
        # finished requests whose next chunk is still in flight: their slot and pages are held until it
        # lands, then their end point is taken (if `take_point`)
        self.draining: dict[str, tuple[Request, bool]] = {}

    def validate(self, request: NewRequest) -> None:
        validate_request(self.limits, request)

    def add(self, request: NewRequest) -> None:
        """Queues a request that `validate` accepted (the engine loop checks each once, as it arrives);
        its mutable state lives here from now on."""
        self.waiting.append(Request(request))

    def abort(self, request_id: str) -> RequestOutput | None:
        for request in list(self.waiting) + self.running:
            if request.request_id == request_id:
                return self._finish(request, RequestStatus.ABORTED, "abort")
        return None

    @property
    def has_work(self) -> bool:
        """Requests, snapshots to take, or tier moves to send or still out (their TierDone is work)."""
        return bool(self.waiting or self.running or self._saves or self.draining
                    or (self.tiers is not None and self.tiers.busy))

    @property
    def disk_version(self) -> int:
        """Rises whenever the committed disk points change (the engine rewrites its catalog then)."""
        disk = self.tiers.disk if self.tiers is not None else None
        return disk.version if disk is not None else 0

    def disk_entries(self) -> list[DiskEntry]:
        """The committed disk points (their write finished), for the engine's catalog."""
        return self.tiers.disk_entries() if self.tiers is not None else []

    def seed_disk(self, entries: list[DiskEntry]) -> None:
        """The disk tier from the engine's catalog, at startup before any request; ValueError for
        inconsistent entries (nothing is seeded then) or when the disk tier is off."""
        if self.tiers is None:
            if entries:
                raise ValueError("the prefix cache's disk tier is off")
            return
        self.tiers.seed_disk(entries)

    def schedule(self) -> StepPlan:
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        restores: list[StateCopy] = []
        page_copies: list[tuple[int, int]] = []
        loads: list[TierMove] = []
        scheduled: set[str] = set()
        pointed: list[Request] = []  # requests whose chunk ends where a state point is taken
        if self.tiers is not None and self.tiers.disk is not None:
            self._scan_waiting()
        for request in [r for r in self.running if not r.in_prefill] + [r for r in self.running if r.in_prefill]:
            if budget <= 0:
                break
            if request not in self.running or not self._may_schedule(request):  # preempted earlier in this step
                continue
            length = self._chunk_length(request, budget)
            drafts = self._drafts(request, length, budget)
            if not self._reserve(request, length + len(drafts), scheduled):
                continue  # the request itself was preempted
            chunks.append(self._launch(request, budget, pointed, drafts))
            scheduled.add(request.request_id)
            budget -= length + len(drafts)
        index = 0
        while index < len(self.waiting) and self.blocks.has_slot() and budget > 0:
            request = self.waiting[index]
            if request.chunks_in_flight:  # preempted while its chunk ran: it resumes once that landed
                index += 1
                continue
            hit = None
            if request.request_id not in self._fetching:
                hit = self._lookup(request)  # a disk hit starts a fetch, which the request then waits for
            if request.request_id in self._fetching:  # the requests behind it go first
                index += 1
                continue
            if not self._admit(request, hit, budget, restores, page_copies, loads):
                break  # admission never preempts
            del self.waiting[index]
            self._scanned.discard(request.request_id)
            request.status = RequestStatus.RUNNING
            if request.scheduled_at is None:  # a preempted request's queue time ended at its first admission
                request.scheduled_at = time.monotonic()
            self.running.append(request)
            chunks.append(self._launch(request, budget, pointed))
            scheduled.add(request.request_id)
            budget -= len(chunks[-1].token_ids)
        self.last_step_tokens = self.limits.max_num_batched_tokens - budget
        self._decide_drafting(chunks)
        self.blocks.close(COPY_SOURCES)
        tiers = self.tiers
        plan = StepPlan(chunks=tuple(chunks), saves=self._take_saves(), restores=tuple(restores),
                        page_copies=tuple(page_copies), tier_moves=tiers.take_moves(loads) if tiers is not None else (),
                        tickets_out=len(tiers.tickets) if tiers is not None else 0,
                        draw_seed=random.getrandbits(63) if chunks else 0)
        # after the plan's copies are taken: these snapshots (and what their evictions spill) ride in
        # the next plan, which runs after this one computed them
        for request in pointed:
            self._take_point(request, confirmed=False)
        return plan

    def _may_schedule(self, request: Request) -> bool:
        """A running request's next chunk can go into this plan: its input is known, or it is a draw
        still in flight that the worker resolves, and that draw is not the request's last."""
        if not request.chunks_in_flight:
            return True
        if request.reads_own_tokens:  # it waits for its chunk in flight to land
            return False
        if not request.draws_in_flight:  # a prompt chunk in flight: the next one's tokens are known
            return True
        if not self.pending_inputs:
            return False
        outputs = len(request.output_token_ids) + request.draws_in_flight
        return outputs < request.params.max_tokens and request.num_tokens < self.limits.max_model_len

    def _drafts(self, request: Request, length: int, budget: int) -> tuple[int, ...]:
        """The proposed drafts the request's next chunk verifies: only a decode chunk's (its one token the
        last known one), cut so that every draft accepted and the token drawn after them still fit the
        step's token budget, max_tokens and max_model_len (its pages are reserved with the chunk's).
        None for a request that cannot take drafts now (`Request.takes_drafts`: a grammar, min_tokens)."""
        drafts = request.drafts
        if not drafts or length != 1 or request.chunks_in_flight or request.num_computed_tokens + 1 != request.num_tokens:
            return ()
        if not request.takes_drafts:
            return ()
        room = min(budget - 1, self._draft_room_after(request))
        if self.spec_policy is not None:
            room = min(room, self.spec_policy.draft_count(len(self.running), len(drafts), request.probing))
        return drafts[: max(room, 0)]

    def _draft_room_after(self, request: Request) -> int:
        """Drafts the chunk after those in flight could verify past its own token, the draws in flight
        counted as landed: what max_tokens and max_model_len leave (`_drafts` cuts to it; none, and
        drafting after the chunk in flight would be wasted)."""
        return min(request.params.max_tokens - len(request.output_token_ids) - request.draws_in_flight - 1,
                   self.limits.max_model_len - request.num_tokens - 1)

    def _decide_drafting(self, chunks: list[ScheduledChunk]) -> None:
        """Whether the proposer drafts after the step's sampling chunks, decided once for the whole step:
        `_launch` left draft_next on for those whose next chunk can take drafts (`Request.takes_drafts`,
        with room for one: `_draft_room_after`),
        and the policy (scheduler/spec_policy.py drafting_next, for the step's batch) answers for all of
        them at once, so that a probe is a whole step and the other steps skip the proposer's launch-bound
        drafting entirely; a probe is remembered for `_drafts`. Without a policy (fixed K) they draft."""
        asking = [index for index, chunk in enumerate(chunks) if chunk.sample and chunk.draft_next]
        if self.spec_policy is None or not asking:
            return
        drafting = self.spec_policy.drafting_next(len(self.running))
        for index in asking:
            self.launched[chunks[index].request_id].probing = drafting is Drafting.PROBE
            if drafting is Drafting.OFF:
                chunks[index] = dataclasses.replace(chunks[index], draft_next=False)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step that forwarded `rows` tokens cost `seconds` (engine/loop.py: from when the device could
        start it to its landing): the cost the draft policy weighs."""
        if self.spec_policy is not None:
            self.spec_policy.observe_step(rows, seconds)

    def _launch(self, request: Request, budget: int, pointed: list[Request],
                drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        """The request's next chunk (verifying `drafts`), counted as computed from now on (a later plan
        runs after it); accepted drafts count when its result lands."""
        chunk = dataclasses.replace(self._chunk(request, budget), draft_token_ids=drafts)
        request.num_computed_tokens += len(chunk.token_ids)
        request.chunks_in_flight += 1
        self.launched[request.request_id] = request
        if chunk.sample:
            request.draws_in_flight += 1
            request.logits_position = request.num_computed_tokens
            request.probing = False  # until `_decide_drafting` makes the step a probe
            chunk = dataclasses.replace(chunk, draft_next=request.takes_drafts and self._draft_room_after(request) > 0)
        if len(chunk.token_ids) > 1 or not chunk.sample:  # a prompt chunk: later prompts may start alike
            pointed.append(request)
        return chunk

    def _take_saves(self) -> tuple[StateCopy, ...]:
        """The snapshots taken since the last plan (a snapshot slot freed and taken again: its last save)."""
        saves = tuple({copy.target: copy for copy in self._saves}.values())
        self._saves = []
        return saves

    def flush(self) -> StepPlan | None:
        """The next plan that puts the GPU's state points on the disk tier as the engine stops, so a restart
        finds them (docs/prefix-tiers.md, "Restart"): tier moves and pending saves, no chunks (running
        requests stay where they are). The most valuable points go first, as many as the host tier takes
        now, each spilled and written through (or only written, when the host holds it); the rest wait for
        this plan's moves to finish. None once every point is on disk (or fits no tier) and every move has
        reported; at once without a disk tier. The engine runs each plan and `update`s with its result."""
        tiers, prefix = self.tiers, self.prefix
        if tiers is None or tiers.disk is None or prefix is None:
            return None
        if self._flushing is None:
            by_value = sorted(prefix.points.values(), key=lambda p: (1 + p.hits) * p.position, reverse=True)
            self._flushing = deque(by_value)
        while self._flushing:
            point = self._flushing[0]
            if not tiers.flush(point, self._snapshot_source(point)):
                if tiers.pinning:
                    break  # room comes as moves finish
                log.warning("prefix disk tier: a %d-token state point fits neither the host nor the disk tier: not"
                            " flushed", point.position)
            self._flushing.popleft()
        if not self._flushing and not tiers.busy and not self._saves:
            return None
        return StepPlan(chunks=(), saves=self._take_saves(), tier_moves=tiers.take_moves(()),
                        tickets_out=len(tiers.tickets))

    def unflushed(self) -> int:
        """GPU points the flush has not put on disk yet: still queued, or with their write still out."""
        writes = sum(t.kind == "write" for t in self.tiers.tickets.values()) if self.tiers is not None else 0
        return len(self._flushing or ()) + writes

    def _scan_waiting(self) -> None:
        """Looks up each request as it joins the queue, so a disk hit's fetch starts then, not when the
        request reaches the head of the queue."""
        for request in self.waiting:
            rid = request.request_id
            if rid not in self._scanned and rid not in self._fetching:
                self._scanned.add(rid)
                self._lookup(request)

    def _lookup(self, request: Request) -> Hit | None:
        """The longest state point across the tiers that the request's tokens start with (equally long:
        the nearest tier). A disk hit is fetched into the host tier and returned: the request waits for
        it (`_fetching`); if the host tier has no room for it, the best hit above the disk instead."""
        if self.prefix is None or request.params.prompt_logprobs is not None:  # echo needs every position
            return None
        salt, tokens, block = request.cache_salt, request.all_token_ids, self.limits.block_tokens
        chain = block_chain(salt, tokens, block, len(tokens) // block)
        gpu = self.prefix.lookup(salt, tokens, count=False, chain=chain)
        hits = [Hit("gpu", gpu.point, gpu.position)] if gpu is not None else []
        if self.tiers is not None:
            host, disk = self.tiers.lookup(salt, tokens, chain)
            hits += [Hit(tier, point, point.position) for tier, point in (("host", host), ("disk", disk))
                     if point is not None]
        hits.sort(key=lambda hit: (-hit.position, TIER_RANK[hit.tier]))
        if hits and hits[0].tier == "disk":
            assert self.tiers is not None and isinstance(hits[0].point, TierPoint)
            ticket = self.tiers.fetch(hits[0].point)
            if ticket is not None:
                self._fetching[request.request_id] = ticket
                return hits[0]
            hits.pop(0)
        return hits[0] if hits else None

    def _admit(self, request: Request, hit: Hit | None, budget: int, restores: list[StateCopy],
               page_copies: list[tuple[int, int]], loads: list[TierMove]) -> bool:
        """Gives the request a slot and pages for its first chunk, resuming from `hit` (a GPU or host
        hit); False (nothing taken) if the pages do not fit."""
        rid = request.request_id
        slot = self.blocks.open(rid)
        tokens = request.all_token_ids
        start = hit.position if hit else 0
        block = self.limits.block_tokens
        full = start // block
        # before the pages are taken: evictions may not free the hit's partial page or its host rows
        if hit is not None and isinstance(hit.point, StatePoint):
            assert self.prefix is not None
            self.blocks.share(rid, hit.point.pages[:full])
            self.prefix.touch(hit.point)
            if start % block and self.tiers is not None:
                self.blocks.tables.setdefault(COPY_SOURCES, [])
                self.blocks.share(COPY_SOURCES, [hit.point.pages[full]])
        elif hit is not None:
            assert self.tiers is not None
            self.tiers.hold(hit.point)
        request.num_computed_tokens = start
        if not self.blocks.grow(rid, start + self._chunk_length(request, budget)):
            self.blocks.close(rid)
            request.num_computed_tokens = 0
            return False
        request.logits_position = start if hit and hit.point.has_logits else -1
        request.slot = slot
        if self.prefix is not None and request.params.prompt_logprobs is None and not request.output_token_ids:
            self.prefix.queried_tokens += len(tokens)
            self.prefix.hit_tokens += start
            request.num_cached_tokens = start
            if hit is not None and hit.tier == "host":
                if rid in self._fetched:
                    self.disk_hit_tokens += start
                else:
                    self.host_hit_tokens += start
        self._fetched.discard(rid)
        if hit is None:
            return True
        if isinstance(hit.point, StatePoint):
            restores.append(StateCopy(hit.point.snapshot, slot))
            if start % block:
                page_copies.append((hit.point.pages[full], self.blocks.table(rid)[full]))
        else:
            assert self.tiers is not None
            loads.append(self.tiers.load(hit.point, slot, self.blocks.table(rid)[: self.blocks.pages_for(start)]))
        log.debug("prefix-cache %s hit: %s resumes at token %d of %d", hit.tier, rid, start, len(tokens))
        return True

    def _chunk_length(self, request: Request, budget: int) -> int:
        """The next chunk's tokens; a prompt chunk ends at the request's cache boundary (to take a
        state point there) when the prefix cache is on."""
        start = request.num_computed_tokens
        end = min(request.num_tokens, start + budget)
        boundary = request.cache_boundary
        if self.prefix is not None and boundary is not None and start < boundary < end and not request.output_token_ids:
            end = boundary
        return end - start

    def _reserve(self, request: Request, length: int, scheduled: set[str]) -> bool:
        """Pages for the request's next `length` tokens, preempting newer unscheduled requests (or,
        if none is left, the request itself) until they fit. False if the request was preempted."""
        needed = request.num_computed_tokens + length
        while not self.blocks.grow(request.request_id, needed):
            # an echo request with a chunk in flight is not preempted: its prompt logprobs are being collected
            victims = [r for r in self.running if r.request_id not in scheduled and r is not request
                       and not (r.chunks_in_flight and r.params.prompt_logprobs is not None)]
            victim = victims[-1] if victims else request
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._take_point(request)
        self.blocks.close(request.request_id)
        self.running.remove(request)
        self.pending_prompt_logprobs.pop(request.request_id, None)
        request.status, request.slot, request.num_computed_tokens = RequestStatus.WAITING, None, 0
        request.drafts = ()  # the resumed prefill proposes afresh
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        tokens = request.all_token_ids
        start = request.num_computed_tokens
        end = start + self._chunk_length(request, budget)
        known = tokens[start:end]  # then the draws in flight, which the worker resolves
        drawn = len(request.output_token_ids) + request.draws_in_flight
        prompt_len = len(request.prompt_token_ids)
        # a request recomputed after preemption already delivered its prompt logprobs with its first token
        wants_prompt_logprobs = (
            request.params.prompt_logprobs is not None and start < prompt_len and not request.output_token_ids
        )
        targets = tuple(tokens[start + 1 : min(end + 1, prompt_len)]) if wants_prompt_logprobs else ()
        history = end == len(tokens) and request.params.penalizes_output  # only a sampling chunk needs it
        return ScheduledChunk(
            request_id=request.request_id,
            slot=request.slot,
            pages=tuple(self.blocks.table(request.request_id)),
            token_ids=(*known, *[PENDING_TOKEN] * (end - start - len(known))),
            position=start,
            sample=end == request.num_tokens,
            logprob_targets=targets,
            params=request.params.for_draw(drawn, self.limits.eos_token_ids),
            num_generated=drawn,
            prompt_token_ids=tuple(request.prompt_token_ids) if history and request.params.penalizes_prompt else (),
            output_token_ids=tuple(request.output_token_ids) if history else (),
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Applies a step's results (its finished tier moves first); returns one output per request that changed."""
        for done in result.tier_done:
            self._tier_done(done)
        if result.draft_steps or result.skipped_draft_steps:
            self.spec = self.spec.add_draft_steps(result.draft_steps, result.skipped_draft_steps)
        outputs = []
        for chunk, chunk_result in zip(plan.chunks, result.chunks, strict=True):
            request = self.launched.get(chunk.request_id)
            if request is None:  # aborted or failed while the step ran
                continue
            self._landed(request, chunk)
            if request.request_id in self.draining:  # it stopped while this chunk ran
                if not request.chunks_in_flight:
                    self._drained(request, ok=chunk_result.error is None)
                continue
            if chunk_result.error is not None:  # only this request fails; the step's others go on
                outputs.append(self._finish(request, RequestStatus.FAILED, "error", chunk_result.error))
                continue
            self._confirm_points(request, chunk.position + len(chunk.token_ids))
            request.num_computed_tokens += len(chunk_result.accepted)  # drafts were computed too
            if chunk.draft_token_ids:
                self.spec = self.spec.add(len(chunk.draft_token_ids), len(chunk_result.accepted))
                if self.spec_policy is not None:
                    self.spec_policy.observe_verify(len(chunk.draft_token_ids), len(chunk_result.accepted))
            request.drafts = chunk_result.proposed
            in_prompt = chunk.position < len(request.prompt_token_ids) and not request.output_token_ids
            # not again when recomputed after preemption, nor for a chunk that ran before the request was preempted
            if chunk.params.prompt_logprobs is not None and in_prompt and request.status is RequestStatus.RUNNING:
                collected = self.pending_prompt_logprobs.setdefault(request.request_id, [None])
                collected.extend(chunk_result.prompt_logprobs)
            if chunk_result.new_tokens:
                outputs.append(self._append_tokens(request, chunk_result.new_tokens))
        return outputs

    def _landed(self, request: Request, chunk: ScheduledChunk) -> None:
        """A chunk's result arrived: it is no longer in flight."""
        request.chunks_in_flight -= 1
        if chunk.sample:
            request.draws_in_flight -= 1
        if not request.chunks_in_flight:
            del self.launched[request.request_id]

    def _confirm_points(self, request: Request, end: int) -> None:
        """The points taken for chunks up to `end` hold their state now: lookups may find them."""
        assert self.prefix is not None or not request.unconfirmed
        for _, point in [entry for entry in request.unconfirmed if entry[0] <= end]:
            self.prefix.confirm(point)
        request.unconfirmed = [entry for entry in request.unconfirmed if entry[0] > end]

    def _discard_points(self, request: Request) -> None:
        """The request's chunks in flight will not be applied: points taken for them would hold no state."""
        if self.prefix is not None:
            for _, point in request.unconfirmed:
                self.prefix.discard(point)
        request.unconfirmed = []

    def _drained(self, request: Request, ok: bool) -> None:
        """A request that stopped while its next chunk ran: that chunk landed, so its slot holds the
        state past its last token, where its end point is taken; then its slot and pages go."""
        _, take_point = self.draining.pop(request.request_id)
        if ok and take_point:
            self._take_point(request)
        self._discard_points(request)
        self.blocks.close(request.request_id)
        request.slot = None

    def _tier_done(self, done: TierDone) -> None:
        """A write or fetch finished (unknown tickets, e.g. forgotten by fail_all, are ignored); the
        requests that waited for a fetch look up again: a host hit now, or after an error a shorter one."""
        ticket = self.tiers.done(done) if self.tiers is not None else None
        if ticket is None or ticket.kind != "fetch":
            return
        for rid in [rid for rid, waited in self._fetching.items() if waited == done.ticket]:
            del self._fetching[rid]
            self._scanned.discard(rid)
            if done.error is None:
                self._fetched.add(rid)

    def _spill(self, point: StatePoint) -> None:
        """A GPU victim goes to the host tier (from `_snapshot_source`); a save into its slot still
        pending is dropped."""
        assert self.tiers is not None
        source = self._snapshot_source(point)
        self._saves = [copy for copy in self._saves if copy.target != point.snapshot]
        self.tiers.spill(point, source)

    def _snapshot_source(self, point: StatePoint) -> int:
        """The model-cache slot holding a point's state for a spill: its snapshot slot, or while the save
        into that slot is pending, the request slot the save copies (it still holds that state: a plan's
        spills run before anything else)."""
        source = point.snapshot
        for copy in self._saves:
            if copy.target == point.snapshot:
                source = copy.source
        return source

    def _append_tokens(self, request: Request, tokens: tuple[TokenLogprob, ...]) -> RequestOutput:
        """Appends a step's new tokens in order (several after a speculative step), checking stop and
        length after each: the tokens after the one that ends the request are dropped."""
        kept: list[TokenLogprob] = []
        reason = None
        for sampled in tokens:
            request.output_token_ids.append(sampled.token_id)
            kept.append(sampled)
            reason = self._stop_reason(request, sampled.token_id)
            if reason is not None:
                break
        prompt_logprobs = self.pending_prompt_logprobs.pop(request.request_id, None)
        if reason is not None:
            # dropped drafts were computed: the slot's state is past the kept tokens, so no end point
            self._release(request, RequestStatus.FINISHED, reason, take_point=len(kept) == len(tokens))
        scheduled_at = request.scheduled_at
        assert scheduled_at is not None, "tokens of a request never scheduled"
        first = len(request.output_token_ids) == len(kept)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tuple(sampled.token_id for sampled in kept),
            new_logprobs=tuple(kept) if request.params.logprobs is not None else (),
            prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs is not None else None,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=scheduled_at - request.arrived_at if first else None,
            inference_time_s=time.monotonic() - scheduled_at,
        )

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        may_stop = len(request.output_token_ids) > params.min_tokens  # min_tokens: the sampler bans these too
        if may_stop and not params.ignore_eos and token in self.limits.eos_token_ids:
            return "stop"
        if may_stop and token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if len(request.all_token_ids) >= self.limits.max_model_len:
            return "length"
        return None

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The step failed: every running request ends with the error; waiting ones stay queued. The
        step's snapshot copies may not have run, so the prefix cache starts over: its GPU and host
        points go, outstanding tier moves are forgotten; committed disk points stay (a fetch verifies)."""
        if self.prefix is not None:
            self.prefix.clear()
            self._saves.clear()
        if self.tiers is not None:
            self.tiers.drop_host()
            self._fetching.clear()
            self._fetched.clear()
            self._scanned.clear()
        for request, _ in list(self.draining.values()):  # their outputs went out already
            self.draining.pop(request.request_id)
            self.blocks.close(request.request_id)
            request.slot = None
        for request in self.waiting:  # preempted while their chunks ran: they recompute from their known tokens
            request.chunks_in_flight = request.draws_in_flight = 0
            request.unconfirmed = []
        self.launched.clear()
        return [self._finish(request, RequestStatus.FAILED, "error", message) for request in list(self.running)]

    def _finish(self, request: Request, status: RequestStatus, reason: str, error: str | None = None) -> RequestOutput:
        self._release(request, status, reason)
        self.pending_prompt_logprobs.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            finished=True,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
        )

    def _take_point(self, request: Request, confirmed: bool = True) -> None:
        """A prefix-cache point at the request's computed tokens; its slot is snapshotted next step. A
        point taken while the request has chunks in flight is confirmed when they land."""
        if self.prefix is None or not request.num_computed_tokens:
            return
        assert request.num_computed_tokens <= len(request.all_token_ids), "a state point over a draw in flight"
        tokens = tuple(request.all_token_ids[: request.num_computed_tokens])
        has_logits = request.logits_position == request.num_computed_tokens
        confirmed = confirmed and not request.chunks_in_flight
        point = self.prefix.insert(request.cache_salt, tokens, tuple(self.blocks.table(request.request_id)), has_logits,
                                   confirmed=confirmed)
        if point is not None:
            self._saves.append(StateCopy(request.slot, point.snapshot))
            if not confirmed:
                request.unconfirmed.append((point.position, point))

    def _release(self, request: Request, status: RequestStatus, reason: str, take_point: bool = True) -> None:
        request.status, request.finish_reason = status, reason
        if status is RequestStatus.FINISHED and request.chunks_in_flight and request in self.running:
            # its next chunk runs on its slot: the slot and pages are held until it lands (`_drained`)
            self.running.remove(request)
            self.draining[request.request_id] = (request, take_point)
            self._fetching.pop(request.request_id, None)
            return
        if take_point and status is RequestStatus.FINISHED and request in self.running:
            self._take_point(request)  # a follow-up turn continues from here
        if request.chunks_in_flight:  # aborted or failed: what its chunks in flight compute is not applied
            self._discard_points(request)
            self.launched.pop(request.request_id, None)
            request.chunks_in_flight = request.draws_in_flight = 0
        if request in self.running:
            self.running.remove(request)
            self.blocks.close(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.slot = None
        self._fetching.pop(request.request_id, None)  # its fetch still completes; the host point stays
        self._scanned.discard(request.request_id)
        self._fetched.discard(request.request_id)

    def stats(self) -> SchedulerStats:
        prefix, tiers = self.prefix, self.tiers
        disk = tiers.disk if tiers is not None else None
        return SchedulerStats(
            len(self.running), len(self.waiting), self.num_preemptions, self.last_step_tokens, self.blocks.stats(),
            prefix.queried_tokens if prefix else 0, prefix.hit_tokens if prefix else 0, prefix.num_points if prefix else 0,
            host_points=len(tiers.host.points) if tiers is not None else 0,
            disk_points=len(disk.points) if disk is not None else 0,
            host_hit_tokens=self.host_hit_tokens, disk_hit_tokens=self.disk_hit_tokens,
            fetch_failures=tiers.fetch_failures if tiers is not None else 0, spec=self.spec,
        )

    def check_integrity(self) -> None:
        """Pages and slots add up in every tier, and exactly the running requests hold them."""
        cache_refs = None
        if self.prefix is not None:
            self.prefix.check_integrity(self.limits.prefix_snapshots)
            cache_refs = [0] * self.blocks.num_pages
            for point in self.prefix.points.values():
                for page in point.pages:
                    cache_refs[page] += 1
        self.blocks.check_integrity(cache_refs)
        holders = {r.request_id for r in self.running} | set(self.draining)
        assert set(self.blocks.slots) == holders, "slots held by requests that are not running"
        assert all(self.blocks.slots[r.request_id] == r.slot for r in self.running), "a request lost its slot"
        assert all(r.request_id in self.launched for r in (*self.running, *self.waiting) if r.chunks_in_flight) \
            and all(r.chunks_in_flight for r in self.launched.values()), "chunks in flight not tracked"
        if self.tiers is not None:
            self.tiers.check_integrity()
            waiting = {r.request_id for r in self.waiting}
            assert all(rid in waiting and self.tiers.tickets[t].kind == "fetch" for rid, t in self._fetching.items()), \
                "a request waits for a fetch that is not out, or is not waiting"
