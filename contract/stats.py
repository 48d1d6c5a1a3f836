"""Figures the engine reports to the front end (metrics, /health): snapshots, never live objects."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Upper edges (seconds) of the Engram prefetch-wait histogram that the engine reports.
PREFETCH_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Upper edges (tokens) of the tokens-per-step histogram: vLLM's vllm:iteration_tokens_total buckets.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class StepTokens:
    """Tokens run by each engine step since start, as a cumulative histogram (`buckets`: counts per
    STEP_TOKEN_BUCKETS edge). A step is its own observation, so the engine accumulates it: the stats
    it sends about once a second could not carry every step."""

    count: int = 0
    total: int = 0
    buckets: tuple[int, ...] = (0,) * len(STEP_TOKEN_BUCKETS)

    def observe(self, tokens: int) -> StepTokens:
        buckets = tuple(n + (tokens <= edge) for n, edge in zip(self.buckets, STEP_TOKEN_BUCKETS))
        return StepTokens(self.count + 1, self.total + tokens, buckets)


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's counts since start, as vLLM's spec_decode metrics count them: verify
    chunks that carried drafts, the drafts they carried, the drafts accepted, and how many chunks
    accepted a draft at each position (0 = the first draft). ds4serve's own: the proposer's draft steps
    (its drafting after a sampling chunk) run, and those skipped while the draft policy verified none."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_steps: int = 0
    skipped_draft_steps: int = 0

    def add(self, carried: int, accepted: int) -> SpecDecodeCounts:
        per_position = list(self.accepted_per_position) + [0] * max(0, carried - len(self.accepted_per_position))
        for position in range(accepted):
            per_position[position] += 1
        return replace(self, drafts=self.drafts + 1, draft_tokens=self.draft_tokens + carried,
                       accepted_tokens=self.accepted_tokens + accepted, accepted_per_position=tuple(per_position))

    def add_draft_steps(self, run: int, skipped: int) -> SpecDecodeCounts:
        return replace(self, draft_steps=self.draft_steps + run, skipped_draft_steps=self.skipped_draft_steps + skipped)


@dataclass(frozen=True)
class EngramStats:
    """The Engram row store's counters since start: rows served per tier, disk reads, and how long
    Engram layers waited for their rows (`wait_buckets`: cumulative counts per PREFETCH_WAIT_BUCKETS edge)."""

    rows_resident: int = 0
    rows_device_cache: int = 0
    rows_host_cache: int = 0
    rows_disk: int = 0
    bytes_read: int = 0
    read_errors: int = 0
    wait_count: int = 0
    wait_sum_s: float = 0.0
    wait_buckets: tuple[int, ...] = (0,) * len(PREFETCH_WAIT_BUCKETS)


@dataclass(frozen=True)
class ExpertOffloadStats:
    """Expert offload's counters since start over this rank's MoE layers (models/expert_offload.py):
    routed pairs whose expert was resident or staged from host RAM, host experts copied in (and their
    bytes), staging hits (already there), and swaps by measured routing."""

    pairs_resident: int = 0
    pairs_staged: int = 0
    copies: int = 0
    bytes_copied: int = 0
    staging_hits: int = 0
    swaps: int = 0


@dataclass(frozen=True)
class EngineStats:
    """Load and cache figures for metrics; read off the loop's thread, so a snapshot, not a barrier."""

    running: int
    waiting: int
    preemptions: int = 0  # since start
    pages_total: int = 0
    pages_held: int = 0
    pages_cached: int = 0  # reusable by the prefix cache, evictable
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which found there
    prefix_gpu_points: int = 0  # the prefix cache's state points in each tier now (docs/prefix-tiers.md)
    prefix_host_points: int = 0
    prefix_disk_points: int = 0
    prefix_host_hits: int = 0  # of prefix_cache_hits, the tokens loaded from the host tier, since start
    prefix_disk_hits: int = 0  # and those fetched from the disk tier first
    prefix_fetch_failures: int = 0  # disk fetches that failed their read or verification (recomputed), since start
    steps: int = 0
    last_step_tokens: int = 0
    step_tokens: StepTokens = StepTokens()
    spec: SpecDecodeCounts = SpecDecodeCounts()  # speculative decoding, since start
    engram: EngramStats | None = None  # None: the model has no tiered Engram store
    offload: ExpertOffloadStats | None = None  # expert offload's counters (None: no offload)
    unhealthy: str | None = None  # why the executor cannot run steps now (a tensor-parallel restart)
