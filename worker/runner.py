"""Model runner: one step of one worker, as prepare -> forward -> sample -> report over a StepContext.

- prepare: the prefix cache's state copies (its host and disk tiers' moves too), then the step's layout:
  the chunks to compute, the logit rows each wants, and which of them run as captured decode-graph rows
  and which as an eager flat batch. With graphs on, a step's one-token chunks run in the graph even when
  prefill chunks share the step (`graph_chunks`), so decodes keep their graph speed while prompts are
  prefilled in chunks; the prefill chunks (and any chunk the graph cannot take) run eagerly.
- forward: graph replay, then the eager forward, on the same stream (their chunks use different cache
  slots); fills each chunk's logits and Engram read failures.
- sample: every sampling row of the step in one batched draw (worker/sampler.py), and echo logprobs.
- report: hints the next step's Engram rows, builds the StepResult (with the prefix disk tier's moves
  that finished since the last step: worker/prefix_tiers.py).

`launch` runs prepare, forward and sample and returns as soon as they are queued: the draws stay on
the device, their copy to the host under way (worker/sampler.py `Draws`), and `result()` of the
returned step reads them and reports. The next plan may be launched before that (overlapped
scheduling): its decode chunks whose input is PENDING_TOKEN take the token this runner drew for their
request in the step launched before, on the device. Nothing in a launch waits for the device (inputs go
through pinned memory, models/transfer.py), except a step with echo logprobs, which reads them at
once. V4.1's Engram rows are hashed from the step's tokens: a graphed decode hashes its static token
column on the device (after the pending tokens are taken into it), an eager chunk reads its resolved
tokens back (a wait for the step before); either way a pending input is hashed as the token it is.
Where Engram rows are read from disk, the runner takes no pending inputs: a landed step's sampled
tokens hint the next step's reads (`_hint_next_rows`), which need that step's look-backs as they were.

The runner owns the caller-owned buffers of the forward: the hybrid cache (slots and pages, sized by
the memory plan) and the logits output, so serving steps after warm-up allocate no persistent memory.

Speculative decoding (issue 27): a chunk may carry `draft_token_ids` (at most `draft_tokens`); the
runner forwards them after the chunk's token, draws at every position and keeps the drafts while each
is the token drawn there (`_verify`), reporting them as `accepted`. Rolling back a rejected draft needs
nothing: a forward moves each slot's fixed state (window rings, compressor groups) past every token it
computes, and a cache allocated with `draft_tokens` (ModelCache.allocate) gives those rings that many
spare rows, so the slot simply resumes at the accepted position (tests/test_draft_rollback.py). V4.1's
Engram look-back is the exception: it is a slot's last tokens, so a verify chunk that rejected a draft
puts the look-back it had before back, advanced over the tokens that stand (EngramMemory.rewind). With a
`proposer` (worker/proposers.py) the runner then asks it for each sampling request's next drafts,
reported as ChunkResult.proposed (none after a chunk whose `draft_next` is off: the proposer then only
keeps its own state; StepResult counts its draft steps run and skipped). With graphs, verify chunks
replay verify graphs (worker/cuda_graphs.py: 1 + draft_tokens rows a sequence, wave-major, a step's
plain decodes padded alongside; V4.1's too, its Engram rows hashed wave by wave), which also keep the
streams an MTP proposer reads, and the MTP proposer drafts after a step's decode chunks by graphs of its
own (worker/mtp_graphs.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from contract import (
    PENDING_TOKEN,
    TIER_MOVES,
    ChunkResult,
    EngramStats,
    ExpertOffloadStats,
    PrefixTierLimits,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TierDone,
    TierMove,
    TokenLogprob,
)
from kernels.batch_invariant import BatchInvariantMode
from kernels.moe import grouped_mm_supported
from models import SINGLE, DeepseekV4, ForwardBatch, ModelCache, TensorParallel
from models.expert_offload import offload_totals
from models.host_tier import HostTierSpec
from models.model_v41 import DeepseekV41
from models.moe import lay_out_experts_for_mma
from models.transfer import on_device
from worker.cuda_graphs import DecodeGraphs, DecodeRow
from worker.prefix_tiers import DiskTier, HostTier, Tickets
from worker.proposers import ComputedChunk, DraftProposer
from worker.sampler import NOT_DRAWABLE, DrawRow, Draws, draw_rows, prompt_logprobs

# a plan with no chunks but tier moves in flight waits this long at most for a completion (blocking on
# the completions queue, not spinning), so an engine waiting only on the disk tier neither spins nor stalls
TIER_WAIT_S = 0.005
NO_PREFIX_TIERS = PrefixTierLimits()


@dataclass
class StepContext:
    """One step on its way through the runner: prepare sets the layout, forward fills `logits` and
    `errors`, sample fills `sampled` and `prompt_logprobs`, report reads them all.

    The layout splits `computed` in two (by index): `graph_chunks` run as the decode graph's rows
    `graph_rows`, `eager_chunks` as the eager forward's flat `batch`. A pure decode step is all graph, a
    step without graphs (or whose one-token chunks fit no graph) all eager, a mixed one both."""

    plan: StepPlan
    computed: list[ScheduledChunk]  # chunks with tokens to forward (the others resume a cached state point)
    logit_rows: list[list[int]]  # per computed chunk: its rows whose logits are wanted
    graph_chunks: tuple[int, ...] = ()  # indices into `computed` of the chunks the decode graph runs, in row order
    # those chunks as the graph's rows, wave by wave (one wave: a decode step; more: a verify step whose
    # sequences have their j-th forwarded token in wave j, None where one has fewer); None: no graph runs
    graph_rows: list[list[DecodeRow | None]] | None = None
    eager_chunks: tuple[int, ...] = ()  # indices into `computed` of the chunks the eager forward runs, in batch order
    batch: ForwardBatch | None = None  # their flat batch (None: no eager forward this step)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> its wanted rows' logits
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its chunk could not be computed or drawn
    drawing: list[ScheduledChunk] = field(default_factory=list)  # the chunks drawn, in the rows of `draws`
    draws: Draws | None = None
    sampled: dict[str, TokenLogprob] = field(default_factory=dict)
    accepted: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)  # a drafting chunk's passed drafts
    # the pre-head residual streams of each chunk's forwarded rows (for a proposer that reads them)
    streams: dict[str, torch.Tensor] = field(default_factory=dict)
    # V4.1: the last pre mixes at the same rows [rows, hc_mult] (float32)
    pres: dict[str, torch.Tensor] = field(default_factory=dict)
    # each chunk's taps: the mean stream entering each of the proposer's tap layers [rows, taps, hidden]
    taps: dict[str, torch.Tensor] = field(default_factory=dict)
    proposed: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the proposer's next drafts
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    look_backs: dict[str, list[int]] = field(default_factory=dict)  # V4.1: a drafting chunk's Engram look-back before it


@dataclass(frozen=True)
class LastDraws:
    """The draws of the step launched last: the next plan's PENDING_TOKEN inputs are taken from them."""

    rows: dict[str, int]  # request id -> its row of `tokens`
    tokens: torch.Tensor  # [n] int64 on the device


@dataclass
class LaunchedRunnerStep:
    """A step `ModelRunner.launch` queued; `result()` reads its draws and reports (once)."""

    runner: "ModelRunner"
    step: StepContext

    def result(self) -> StepResult:
        return self.runner._report(self.step)


class ModelRunner:
    """Owns the model and its per-slot cache; `execute` is the whole step of one worker."""

    def __init__(
        self,
        model: DeepseekV4 | DeepseekV41,
        num_slots: int,
        max_model_len: int,
        device: str = "cpu",
        num_pages: int | None = None,
        block_tokens: int | None = None,
        max_logit_rows: int = 0,
        deterministic: bool = False,
        snapshot_slots: int = 0,
        tp: TensorParallel = SINGLE,
        cuda_graphs: bool = False,
        kv_cache_dtype: str = "auto",
        kv_hot_tokens: int | None = None,
        prefix_tiers: PrefixTierLimits = NO_PREFIX_TIERS,
        prefix_dir: Path | None = None,
        rank: int | None = None,
        draft_tokens: int = 0,
        proposer: DraftProposer | None = None,
    ) -> None:
        """Without `num_pages` every slot gets pages for `max_model_len` tokens (tests); the engine
        passes its memory plan's page count and each chunk's block table. `deterministic` runs every
        step batch-invariant (kernels/batch_invariant.py): bitwise the same outputs whatever shares it.
        `snapshot_slots` more cache slots (after the requests' ones) hold the prefix cache's snapshots.
        `tp`: the model's tensor-parallel group (Engram read failures are combined over it).
        `cuda_graphs`: decode steps replay CUDA graphs (worker/cuda_graphs.py) of the model's decode
        path (V4 and V4.1 have one), and mixed steps replay them for their decode rows while their
        prefill chunks run eagerly (`graph_chunks`), where the device is a GPU with grouped GEMMs for its dtype (bf16, sm90+), the group
        has one rank and the mode is not deterministic (batch-invariant kernels run eagerly); the cache
        then has one more slot and page (scratch). `kv_cache_dtype`: "fp4" packs V4.1's paged entries
        (models/packed_pages.py). `kv_hot_tokens`: those entries live in a host tier, with each running
        sequence's last `kv_hot_tokens` tokens' pages in a GPU ring (models/host_tier.py).
        `prefix_tiers`: the prefix cache's host tier (and disk tier, in `prefix_dir`/rank<`rank`>, `rank`
        defaulting to the group's) below its snapshot slots (worker/prefix_tiers.py). `draft_tokens`: the
        most drafts a chunk may carry for verification (the cache's rings get as many spare rows: see
        the module docstring). `proposer`: proposes each sampling request's next drafts after a step
        (worker/proposers.py; the decode and verify graphs keep the streams an MTP proposer reads, or the
        taps a DSpark proposer reads). Its drafts come from a step's result, so a step that verifies
        drafts or drafts next lands before the next one is planned (engine/loop.py); the others overlap,
        their chunks' pending inputs resolved for the proposer from the tokens the step before drew."""
        self.model = model
        self.proposer = proposer
        self.tp = tp
        self.deterministic = deterministic
        self.draft_tokens = draft_tokens
        # drafts are proposed from a landed step; Engram reads ahead from disk are hinted from one
        engram = model.engram_memory
        self.pending_inputs = engram is None or not engram.reads_ahead
        self.proposes_drafts = proposer is not None
        self._drawn: dict[str, int] = {}  # each request's token drawn by the last reported step
        self._last_draws: LastDraws | None = None
        dtype = model.lm_head.weight.dtype
        if dtype == torch.bfloat16 and str(device).startswith("cuda") and not deterministic:
            lay_out_experts_for_mma(model)  # MXFP4 experts as the CUDA decode kernel reads them
        graphs = (cuda_graphs and str(device).startswith("cuda") and grouped_mm_supported(model.lm_head.weight)
                  and not deterministic and tp.world_size == 1)
        scratch = 1 if graphs else 0
        self.cache = ModelCache.allocate(
            model.config, num_slots + snapshot_slots + scratch, max_model_len, dtype=dtype, device=device,
            num_pages=None if num_pages is None else num_pages + scratch, block_tokens=block_tokens,
            kv_cache_dtype=kv_cache_dtype,
            host_tier=None if kv_hot_tokens is None else HostTierSpec(kv_hot_tokens, num_slots),
            draft_tokens=draft_tokens,
        )
        self.device = device
        self.graphs: DecodeGraphs | None = None
        if graphs:
            scratch_slot = num_slots + snapshot_slots
            scratch_page = num_pages if num_pages is not None else int(self.cache.default_pages(scratch_slot)[0])
            max_pages = -(-max_model_len // self.cache.block_tokens)
            self.graphs = DecodeGraphs(model, self.cache, num_slots, max_pages, scratch_slot, scratch_page,
                                       waves=1 + draft_tokens, keep_streams=self._keeps_streams,
                                       keep_taps=self.proposer.tap_layers if self._keeps_taps else ())
            self.graphs.capture()
        # the proposer's drafting graphs (the MTP layer's), beside the decode graphs' pool in the memory plan
        self.proposer_graph_bytes = proposer.capture_graphs() if graphs and proposer is not None else 0
        rows = max(max_logit_rows, num_slots)
        self.logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)
        # with a prefix cache: each slot's logits of its last sampled position, part of the slot's state,
        # so that a request whose whole prompt is cached draws its first token without a forward
        self.last_logits = None
        if snapshot_slots:
            self.last_logits = torch.zeros(num_slots + snapshot_slots, model.config.vocab_size, device=device)
        self.host_tier, self.disk_tier = self._prefix_tiers(prefix_tiers, prefix_dir, tp.rank if rank is None else rank)
        self.tickets = Tickets(tp, self.logits.device)

    def _prefix_tiers(self, limits: PrefixTierLimits, directory: Path | None,
                      rank: int) -> tuple[HostTier | None, DiskTier | None]:
        host = HostTier(self.cache, self.last_logits, limits.host_slots, limits.host_pages) if limits.host else None
        if not limits.disk:
            return host, None
        if directory is None:
            raise ValueError("the prefix cache's disk tier needs its directory (prefix_cache.dir)")
        return host, DiskTier(host, Path(directory) / f"rank{rank}", limits.disk_slots, limits.disk_pages)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step: the stages below, in order, over one StepContext."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> LaunchedRunnerStep:
        """Queues prepare, forward and sample; the step's `result()` waits for its draws and reports."""
        step = self._prepare(plan)
        self._forward(step)
        self._sample(step)
        return LaunchedRunnerStep(self, step)

    # -- prepare ----------------------------------------------------------------------------------
    def _prepare(self, plan: StepPlan) -> StepContext:
        """Makes the prefix cache's copies and lays the step out for the forward."""
        self._check_drafts(plan)
        self._copy_prefix_state(plan)
        computed = [chunk for chunk in plan.chunks if chunk.token_ids]
        step = StepContext(plan, computed, [self._rows_wanted(chunk) for chunk in computed])
        context = self.cache.engram_context
        drafting = [c for c in computed if c.draft_token_ids]
        if context is not None and drafting:  # V4.1: the look-backs a rejected draft would leave advanced
            held = context[on_device([c.slot for c in drafting], torch.long, context.device)].tolist()
            step.look_backs = {c.request_id: back for c, back in zip(drafting, held)}
        if computed:
            self.cache.hold_hot([(c.pages, c.position + len(_forwarded(c))) for c in computed])
            self._lay_out(step)
        return step

    def _lay_out(self, step: StepContext) -> None:
        """Splits the computed chunks between the decode graph and the eager forward (`graph_partition`)
        and builds each part's inputs."""
        fits = self._graph_fits if self.graphs is not None else None
        step.graph_chunks = graph_partition(step.computed, step.logit_rows, fits)
        graphed = set(step.graph_chunks)
        step.eager_chunks = tuple(i for i in range(len(step.computed)) if i not in graphed)
        if step.graph_chunks:
            step.graph_rows = self._decode_rows([step.computed[i] for i in step.graph_chunks])
        if step.eager_chunks:
            eager = [step.computed[i] for i in step.eager_chunks]
            step.batch = self._pending_resolved(ForwardBatch.build(
                [(c.slot, [max(t, 0) for t in _forwarded(c)], c.position, list(c.pages)) for c in eager],
                logits=[step.logit_rows[i] for i in step.eager_chunks],
            ), eager)

    def _draw_row(self, chunk: ScheduledChunk) -> int:
        """The row of the last step's draws that a chunk's PENDING_TOKEN input is (-1: its token is known).
        A request without a draw there failed in that step: its chunk computes token 0 and its result
        is not applied."""
        if chunk.token_ids[-1] != PENDING_TOKEN:
            return -1
        if len(chunk.token_ids) != 1:
            raise ValueError(f"chunk of {chunk.request_id}: only a one-token decode chunk may have a pending input")
        last = self._last_draws
        return last.rows.get(chunk.request_id, -1) if last is not None else -1

    def _pending_resolved(self, batch: ForwardBatch, computed: list[ScheduledChunk]) -> ForwardBatch:
        """The eager batch with its PENDING_TOKEN inputs taken from the last step's draws, on the device."""
        pending = [(batch_chunk.start, row) for chunk, batch_chunk in zip(computed, batch.chunks)
                   if (row := self._draw_row(chunk)) >= 0]
        if not pending:
            return batch
        assert self._last_draws is not None
        batch = batch.to(self.logits.device)
        token_ids = batch.token_ids.clone()
        flat, rows = zip(*pending)
        device = token_ids.device
        token_ids[on_device(flat, torch.long, device)] = self._last_draws.tokens[on_device(rows, torch.long, device)]
        return replace(batch, token_ids=token_ids)

    def _copy_prefix_state(self, plan: StepPlan) -> None:
        """In docs/prefix-tiers.md's order: spills (they free GPU slots and pages the plan may hand out
        again), the disk tier's writes and fetches (queued for its threads), snapshots (they read slots
        as the last step left them), restores, loads, then pages."""
        moves = self._tier_moves(plan)
        if moves["spill"]:
            self.host_tier.spill(moves["spill"])
        if moves["write"] or moves["fetch"]:
            ready = self.host_tier.ready()  # after the spills: what the writer waits for
            self.tickets.issue(moves["write"] + moves["fetch"])
            self.disk_tier.write(moves["write"], ready)
            self.disk_tier.fetch(moves["fetch"], ready)
        for copies in (plan.saves, plan.restores):
            sources, targets = [c.source for c in copies], [c.target for c in copies]
            self.cache.copy_slots(sources, targets)
            if copies and self.last_logits is not None:
                self.last_logits[targets] = self.last_logits[sources]
        if moves["load"]:
            self.host_tier.load(moves["load"])
        self.cache.copy_pages([s for s, _ in plan.page_copies], [t for _, t in plan.page_copies])

    def _tier_moves(self, plan: StepPlan) -> dict[str, list[TierMove]]:
        """The plan's tier moves by kind; refused if a tier they need is off."""
        moves: dict[str, list[TierMove]] = {kind: [] for kind in TIER_MOVES}
        for move in plan.tier_moves:
            if move.kind not in moves:
                raise ValueError(f"unknown tier move kind {move.kind!r} (ticket {move.ticket})")
            moves[move.kind].append(move)
        disk = moves["write"] or moves["fetch"]
        if (plan.tier_moves and self.host_tier is None) or (disk and self.disk_tier is None):
            raise ValueError(f"the plan moves prefix state to or from a tier this runner does not have "
                             f"(host tier {'on' if self.host_tier else 'off'}, disk tier {'on' if self.disk_tier else 'off'})")
        return moves

    @property
    def _keeps_streams(self) -> bool:
        return self.proposer is not None and self.proposer.needs_streams

    @property
    def _keeps_taps(self) -> bool:
        return self.proposer is not None and bool(self.proposer.tap_layers)

    def _decode_rows(self, chunks: list[ScheduledChunk]) -> list[list[DecodeRow | None]]:
        """One-token chunks (and their drafts) as the decode graph's rows, wave by wave: 1 + the most
        drafts a chunk carries (the verify graph of that many waves; a chunk with fewer pads its missing
        waves). A PENDING_TOKEN input names its row of the last step's draws, which the graph gathers on
        the device."""
        assert self.graphs is not None
        waves = 1 + max(len(c.draft_token_ids) for c in chunks)
        rows: list[list[DecodeRow | None]] = [[] for _ in range(waves)]
        for c in chunks:
            forwarded = _forwarded(c)
            rows[0].append(DecodeRow(c.slot, max(c.token_ids[0], 0), c.position, c.pages, self._draw_row(c)))
            for j in range(1, waves):
                rows[j].append(DecodeRow(c.slot, forwarded[j], c.position + j, c.pages) if j < len(forwarded) else None)
        return rows

    def _graph_fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether one captured bucket holds these one-token chunks (batch size and block-table width),
        and verify graphs were captured if some carry drafts (a runner without draft tokens has none)."""
        assert self.graphs is not None
        if self.graphs.waves[-1] == 1 and any(c.draft_token_ids for c in chunks):
            return False
        return self.graphs.fits(len(chunks), max(len(c.pages) for c in chunks))

    @staticmethod
    def _rows_wanted(chunk: ScheduledChunk) -> list[int]:
        """The chunk's rows whose logits are kept: one per echo target, and the last if it samples (with
        drafts: the last token's and every draft's, the rows verification draws)."""
        rows = list(range(len(chunk.logprob_targets)))
        last = len(chunk.token_ids) - 1
        if chunk.sample and (not rows or rows[-1] != last):
            rows.append(last)
        rows.extend(range(last + 1, last + 1 + len(chunk.draft_token_ids)))
        return rows

    def _check_drafts(self, plan: StepPlan) -> None:
        """Drafts are verified only where the cache can roll them back (`draft_tokens` spare rows), on a
        sampling chunk whose inputs are known (a pending input's drafts could not have been proposed)
        and without a grammar (its bitmask after each draft is not known here yet)."""
        for chunk in plan.chunks:
            drafts = chunk.draft_token_ids
            if not drafts:
                continue
            if len(drafts) > self.draft_tokens:
                raise ValueError(f"chunk of {chunk.request_id}: {len(drafts)} draft tokens, this runner verifies at "
                                 f"most {self.draft_tokens} (draft_tokens)")
            if not chunk.sample or not chunk.token_ids or PENDING_TOKEN in chunk.token_ids or chunk.token_bitmask:
                raise ValueError(f"chunk of {chunk.request_id}: drafts are verified on a sampling chunk with known "
                                 "inputs and no grammar")

    # -- forward ----------------------------------------------------------------------------------
    def _forward(self, step: StepContext) -> None:
        """The graph's part first, then the eager part, queued on the current stream one after the other:
        the host launches the eager kernels while the graph runs. Their outputs are different buffers
        (the graph's static output, the runner's `logits`), so neither overwrites the other before
        sampling; each part's Engram failures are read right after its own forward."""
        if step.graph_rows is not None:
            self._replay(step)
        if step.batch is not None:
            self._forward_eager(step)
        self._keep_last_logits(step)

    def _replay(self, step: StepContext) -> None:
        """The decode graph over the step's graph chunks: one logits row per chunk (if it wants one)."""
        waves = step.graph_rows
        logits = self.graphs.run_waves(waves, self._last_draws.tokens if self._last_draws is not None else None)
        size = logits.shape[0] // len(waves)
        # a failed Engram row fails its sequence, whichever wave it is in (wave j's rows from j * size on);
        # a padding row's failure fails nothing
        failed = {}
        for flat, reason in self._engram_failures(logits.shape[0]).items():
            wave, row = divmod(flat, size)
            if row < len(waves[wave]) and waves[wave][row] is not None:
                failed.setdefault(row, reason)
        # what the proposer reads of the rows, copied out of the static buffers (one copy each): the next
        # replay rewrites them, and with overlap it may be launched before this step is reported
        used = logits.shape[0]
        kept = [(buffer[:used].clone(), into) for buffer, into in
                ((self.graphs.streams, step.streams), (self.graphs.pre, step.pres), (self.graphs.taps, step.taps))
                if buffer is not None]
        for row, index in enumerate(step.graph_chunks):
            chunk, wanted = step.computed[index], step.logit_rows[index]
            if len(waves) == 1:
                step.logits[chunk.request_id] = logits[row : row + len(wanted)]
            else:  # wave-major: the chunk's rows are `size` apart
                step.logits[chunk.request_id] = logits[row : row + size * len(wanted) : size]
            forwarded = slice(row, row + size * len(_forwarded(chunk)), size)
            for rows, into in kept:
                into[chunk.request_id] = rows[forwarded]
            if row in failed:
                step.errors[chunk.request_id] = failed[row]

    def _forward_eager(self, step: StepContext) -> None:
        """The eager forward over the step's eager chunks, into the runner's logits buffer when it holds
        the rows."""
        batch = step.batch
        chunks = [step.computed[i] for i in step.eager_chunks]
        logit_rows = [step.logit_rows[i] for i in step.eager_chunks]
        n_rows = sum(len(rows) for rows in logit_rows)
        out = self.logits[:n_rows] if n_rows <= self.logits.shape[0] else None
        kept = {}
        if self._keeps_streams:  # an MTP proposer's
            config = self.model.config
            kept["streams_out"] = torch.empty(batch.token_ids.shape[0], config.hc_mult, config.hidden_size,
                                              dtype=self.model.lm_head.weight.dtype, device=self.logits.device)
            if config.is_v41:  # its last pre mixes too
                kept["pre_out"] = torch.empty(batch.token_ids.shape[0], config.hc_mult, device=self.logits.device)
        taps = None
        if self._keeps_taps:  # a DSpark proposer's
            layers = self.proposer.tap_layers
            taps = torch.empty(batch.token_ids.shape[0], len(layers), self.model.config.hidden_size,
                               dtype=self.model.lm_head.weight.dtype, device=self.logits.device)
            kept["taps_out"] = {layer: taps[:, i] for i, layer in enumerate(layers)}
        with BatchInvariantMode() if self.deterministic else nullcontext():
            logits = self.model(batch, self.cache, out=out, **kept)
        for chunk, batch_chunk in zip(chunks, batch.chunks):
            rows = slice(batch_chunk.start, batch_chunk.start + batch_chunk.length)
            if "streams_out" in kept:
                step.streams[chunk.request_id] = kept["streams_out"][rows]
            if "pre_out" in kept:
                step.pres[chunk.request_id] = kept["pre_out"][rows]
            if taps is not None:
                step.taps[chunk.request_id] = taps[rows]
        failed = self._engram_failures(batch.token_ids.shape[0])
        offset = 0
        for chunk, rows, batch_chunk in zip(chunks, logit_rows, batch.chunks):
            step.logits[chunk.request_id] = logits[offset : offset + len(rows)]
            offset += len(rows)
            span = range(batch_chunk.start, batch_chunk.start + batch_chunk.length)
            error = next((failed[r] for r in span if r in failed), None)
            if error is not None:
                step.errors[chunk.request_id] = error

    def _keep_last_logits(self, step: StepContext) -> None:
        """With a prefix cache, each sampling slot's last logits are part of its state (see __init__)."""
        if self.last_logits is None:
            return
        sampling = [c for c in step.computed if c.sample and not c.draft_token_ids]  # drafts: in _report
        if sampling:
            slots = on_device([c.slot for c in sampling], torch.long, self.last_logits.device)
            self.last_logits[slots] = torch.stack([step.logits[c.request_id][-1] for c in sampling])

    # -- sample -----------------------------------------------------------------------------------
    def _sample(self, step: StepContext) -> None:
        """Every sampling chunk's draw in one batch, then the echo logprobs of the chunks that ask. A
        row the sampler cannot draw (non-finite logits or distribution) fails its own request only."""
        drawing = [c for c in step.plan.chunks if c.sample and c.request_id not in step.errors]
        self._last_draws = None
        if drawing:
            logits = torch.cat([self._sampling_logits(step, chunk) for chunk in drawing])
            rows = [DrawRow(c.params, c.num_generated + j, c.prompt_token_ids,
                            (*c.output_token_ids, *c.draft_token_ids[:j]) if j else c.output_token_ids, c.token_bitmask)
                    for c in drawing for j in range(len(c.draft_token_ids) + 1)]
            step.drawing, step.draws = drawing, draw_rows(logits, rows, step.plan.draw_seed)
            step.draws.copy_out()
            # a drafting request's next input depends on how many drafts pass: no pending input follows it
            first_rows = itertools.accumulate((len(c.draft_token_ids) + 1 for c in drawing), initial=0)
            self._last_draws = LastDraws({c.request_id: row for c, row in zip(drawing, first_rows)
                                          if not c.draft_token_ids}, step.draws.tokens)
        for chunk in step.computed:
            if chunk.logprob_targets and chunk.request_id not in step.errors:
                step.prompt_logprobs[chunk.request_id] = prompt_logprobs(
                    step.logits[chunk.request_id], chunk.logprob_targets, chunk.params.prompt_logprobs
                )

    def _sampling_logits(self, step: StepContext, chunk: ScheduledChunk) -> torch.Tensor:
        """The rows a chunk draws from [1 + drafts, vocab]: its last token's row and each draft's, or
        (whole prompt cached) its slot's kept one."""
        if not chunk.token_ids:
            return self.last_logits[chunk.slot][None]
        return step.logits[chunk.request_id][-1 - len(chunk.draft_token_ids):]

    # -- report -----------------------------------------------------------------------------------
    def _report(self, step: StepContext) -> StepResult:
        if step.draws is not None:
            tokens = iter(step.draws.read())
            for chunk in step.drawing:
                drawn = [next(tokens) for _ in range(len(chunk.draft_token_ids) + 1)]
                self._verify(step, chunk, drawn)
        run, skipped = self._propose(step) if self.proposer is not None else (0, 0)
        results = [self._chunk_result(step, chunk) for chunk in step.plan.chunks]
        self._hint_next_rows(step.plan, results)
        return StepResult(chunks=tuple(results), tier_done=self._tier_done(step.plan), draft_steps=run,
                          skipped_draft_steps=skipped)

    def _propose(self, step: StepContext) -> tuple[int, int]:
        """The proposer's next drafts (step.proposed) from what the step computed; returns its draft steps
        (run, skipped): the sampling chunks it drafted after, and those whose `draft_next` was off."""
        computed = self._computed_chunks(step)
        step.proposed = self.proposer.propose(computed)
        self._drawn = {item.chunk.request_id: item.next_token for item in computed if item.next_token is not None}
        drafting = [item.chunk.draft_next for item in computed if item.next_token is not None]
        return sum(drafting), len(drafting) - sum(drafting)

    def _verify(self, step: StepContext, chunk: ScheduledChunk, drawn: list[TokenLogprob | None]) -> None:
        """A chunk's draws at its last token and at each draft: drafts are accepted while each is the token
        drawn at its position; the draw at the first that is not (or after the last) is the new token.
        Drawing at a draft's position and comparing is rejection sampling against a one-hot draft
        distribution (worker/spec_verify.py): a draft x passes with probability p(x), and a token drawn
        given it did not is drawn from p without x, the recovered distribution. Greedy rows: the argmax."""
        drafts = chunk.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and drawn[accepted] is not None and drawn[accepted].token_id == drafts[accepted]:
            accepted += 1
        if any(token is None for token in drawn[: accepted + 1]):
            step.errors[chunk.request_id] = NOT_DRAWABLE
            return
        step.sampled[chunk.request_id] = drawn[accepted]
        if drafts:
            step.accepted[chunk.request_id] = tuple(drawn[:accepted])
            if self.last_logits is not None:  # the slot's state ends at the accepted position
                self.last_logits[chunk.slot] = step.logits[chunk.request_id][-1 - len(drafts) + accepted]
            before = step.look_backs.get(chunk.request_id)
            if before is not None and accepted < len(drafts):  # the forward hashed the rejected drafts too
                self.model.engram_memory.rewind(self.cache.engram_context, chunk.slot, before,
                                                [*chunk.token_ids, *drafts[:accepted]])

    def _computed_chunks(self, step: StepContext) -> list[ComputedChunk]:
        """What the step left of each chunk that did not fail, as the proposer reads it: the forwarded
        tokens that stand (a pending input as the token the step before drew: that step was reported
        first), the token drawn after them, their streams and taps."""
        computed = []
        for chunk in step.plan.chunks:
            rid = chunk.request_id
            if rid in step.errors:
                continue
            if chunk.token_ids[-1:] == (PENDING_TOKEN,):  # a one-token decode chunk (scheduler/scheduler.py)
                if rid not in self._drawn:  # its request failed in the step before: this result is not applied
                    continue
                chunk = dataclasses.replace(chunk, token_ids=(self._drawn[rid],))
            sampled = step.sampled.get(rid)
            computed.append(ComputedChunk(chunk, len(chunk.token_ids) + len(step.accepted.get(rid, ())),
                                          None if sampled is None else sampled.token_id, step.streams.get(rid),
                                          step.taps.get(rid), step.pres.get(rid)))
        return computed

    def _tier_done(self, plan: StepPlan) -> tuple[TierDone, ...]:
        """The disk tier's moves finished since the last step (on every rank); a plan with nothing else
        to do but moves in flight first waits a little for one."""
        if self.disk_tier is None:
            return ()
        wait_s = TIER_WAIT_S if not plan.chunks and plan.tickets_out > 0 else 0.0
        return self.tickets.finish(self.disk_tier.finished(wait_s))

    @staticmethod
    def _chunk_result(step: StepContext, chunk: ScheduledChunk) -> ChunkResult:
        request_id = chunk.request_id
        if request_id in step.errors:
            return ChunkResult(request_id=request_id, sampled=None, error=step.errors[request_id])
        return ChunkResult(request_id=request_id, sampled=step.sampled.get(request_id),
                           prompt_logprobs=step.prompt_logprobs.get(request_id, ()),
                           accepted=step.accepted.get(request_id, ()), proposed=step.proposed.get(request_id, ()))

    # -- Engram -------------------------------------------------------------------------------------
    def _engram_failures(self, num_tokens: int) -> dict[int, str]:
        """Tokens (flat batch rows) whose Engram rows could not be read. Each rank reads only its
        heads' rows, so with several ranks the flags are summed over the group: every rank then fails
        the same requests, whichever rank's read broke."""
        memory = self.model.engram_memory
        if memory is None:
            return {}
        failed = memory.failed_tokens()
        if self.tp.world_size > 1:
            flags = torch.zeros(num_tokens, dtype=torch.int32, device=self.logits.device)
            flags[list(failed)] = 1
            for token in self.tp.all_reduce(flags).nonzero().flatten().tolist():
                failed.setdefault(token, "an Engram row of this token could not be read on another tensor-parallel rank")
        return failed

    def _hint_next_rows(self, plan: StepPlan, results: list[ChunkResult]) -> None:
        """Sampled tokens are the next step's inputs: their Engram rows can be read now."""
        memory = self.model.engram_memory
        if memory is None or not memory.reads_ahead:  # every row resident: nothing to read ahead
            return
        sampled = [(chunk, result.sampled.token_id) for chunk, result in zip(plan.chunks, results) if result.sampled]
        if sampled:  # one hint a step
            memory.hint_next([chunk.request_id for chunk, _ in sampled], [chunk.slot for chunk, _ in sampled],
                             [token for _, token in sampled], self.cache.engram_context)

    # -- the rest of the ModelExecutor protocol (contract/executor.py) ------------------------------
    def engram_stats(self) -> EngramStats | None:
        """The Engram store's counters (None without a tiered store)."""
        memory = self.model.engram_memory
        return None if memory is None else memory.stats()

    def offload_stats(self) -> ExpertOffloadStats | None:
        """Expert offload's counters over this runner's layers (None without expert offload)."""
        return offload_totals(self.model)

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its pending Engram prefetches are dropped."""
        memory = self.model.engram_memory
        if memory is not None:
            memory.cancel(request_id)

    def maintain(self) -> bool:
        """One runner has nothing to repair between steps."""
        return False

    def health(self) -> str | None:
        return None

    def close(self) -> None:
        """Stops the prefix disk tier's threads (moves not started are abandoned) and the Engram store's
        I/O thread (before the interpreter tears torch down); the runner's memory goes with it."""
        if self.disk_tier is not None:
            self.disk_tier.close()
        if self.model.engram_memory is not None:
            self.model.engram_memory.close()


def graph_partition(computed: Sequence[ScheduledChunk], logit_rows: Sequence[Sequence[int]],
                    fits: Callable[[list[ScheduledChunk]], bool] | None) -> tuple[int, ...]:
    """Indices (into `computed`, in order) of the chunks a captured decode graph runs; the others run
    eagerly. The graph takes every one-token chunk that wants no more logits rows than it forwards
    tokens (its last token and its drafts: the graph yields one row per forwarded token, so a chunk with
    several echo rows stays eager), whether or not prefill chunks share
    the step, so that decodes do not fall back to the eager path whenever a prompt is prefilled. If
    `fits` (does one captured bucket hold these chunks?) refuses them, or there are no graphs (`fits`
    None), the graph runs nothing and the whole step is eager, as without graphs."""
    if fits is None:
        return ()
    decodes = [i for i, (chunk, rows) in enumerate(zip(computed, logit_rows))
               if len(chunk.token_ids) == 1 and len(rows) <= 1 + len(chunk.draft_token_ids)]
    if not decodes or not fits([computed[i] for i in decodes]):
        return ()
    return tuple(decodes)


def _forwarded(chunk: ScheduledChunk) -> tuple[int, ...]:
    """The tokens a chunk computes: its own, then the drafts to verify."""
    return chunk.token_ids + chunk.draft_token_ids
