"""Model runner: turns a StepPlan into a forward over the flat batch, then samples.

The runner owns the caller-owned buffers of the forward: the hybrid cache (slots and pages, sized by
the memory plan) and the logits output, so serving steps after warm-up allocate no persistent memory.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from contract import ChunkResult, EngramStats, StepPlan, StepResult
from kernels.batch_invariant import BatchInvariantMode
from kernels.moe import grouped_mm_supported
from models import SINGLE, DeepseekV4, ForwardBatch, ModelCache, TensorParallel
from models.host_tier import HostTierSpec
from models.model_v41 import DeepseekV41
from worker.cuda_graphs import DecodeGraphs, DecodeRow
from worker.sampler import argmax_rows, draws_plain_argmax, sample, token_logprobs


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
    ) -> None:
        """Without `num_pages` every slot gets pages for `max_model_len` tokens (tests); the engine
        passes its memory plan's page count and each chunk's block table. `deterministic` runs every
        step batch-invariant (kernels/batch_invariant.py): bitwise the same outputs whatever shares it.
        `snapshot_slots` more cache slots (after the requests' ones) hold the prefix cache's snapshots.
        `tp`: the model's tensor-parallel group (Engram read failures are combined over it).
        `cuda_graphs`: decode steps replay CUDA graphs (worker/cuda_graphs.py) where the model has a
        decode path (V4, V4.1), the device is a GPU with grouped GEMMs for its dtype (bf16, sm90+), the group
        has one rank and the mode is not deterministic (batch-invariant kernels run eagerly); the cache
        then has one more slot and page (scratch). `kv_cache_dtype`: "fp4" packs V4.1's paged entries
        (models/packed_pages.py). `kv_hot_tokens`: those entries live in a host tier, with each running
        sequence's last `kv_hot_tokens` tokens' pages in a GPU ring (models/host_tier.py)."""
        self.model = model
        self.tp = tp
        self.deterministic = deterministic
        dtype = model.lm_head.weight.dtype
        graphs = (cuda_graphs and str(device).startswith("cuda") and hasattr(model, "decode")
                  and grouped_mm_supported(model.lm_head.weight) and not deterministic and tp.world_size == 1)
        scratch = 1 if graphs else 0
        self.cache = ModelCache.allocate(
            model.config, num_slots + snapshot_slots + scratch, max_model_len, dtype=dtype, device=device,
            num_pages=None if num_pages is None else num_pages + scratch, block_tokens=block_tokens,
            kv_cache_dtype=kv_cache_dtype,
            host_tier=None if kv_hot_tokens is None else HostTierSpec(kv_hot_tokens, num_slots),
        )
        self.device = device
        self.graphs: DecodeGraphs | None = None
        if graphs:
            scratch_slot = num_slots + snapshot_slots
            scratch_page = num_pages if num_pages is not None else int(self.cache.default_pages(scratch_slot)[0])
            max_pages = -(-max_model_len // self.cache.block_tokens)
            self.graphs = DecodeGraphs(model, self.cache, num_slots, max_pages, scratch_slot, scratch_page)
            self.graphs.capture()
        rows = max(max_logit_rows, num_slots)
        self.logits = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)
        # with a prefix cache: each slot's logits of its last sampled position, part of the slot's state,
        # so that a request whose whole prompt is cached draws its first token without a forward
        self.last_logits = None
        if snapshot_slots:
            self.last_logits = torch.zeros(num_slots + snapshot_slots, model.config.vocab_size, device=device)

    def execute(self, plan: StepPlan) -> StepResult:
        self._copy_prefix_state(plan)
        computed = [chunk for chunk in plan.chunks if chunk.token_ids]  # the rest resume a cached state point
        logit_rows = [self._rows_wanted(chunk) for chunk in computed]
        chunk_logits: dict[str, torch.Tensor] = {}
        failed_chunks: dict[str, str] = {}
        if computed:
            self.cache.hold_hot([(c.pages, c.position + len(c.token_ids)) for c in computed])
            rows = self._graph_rows(computed)
            if rows is not None:
                self._replay(rows, computed, logit_rows, chunk_logits, failed_chunks)
            else:
                self._forward(computed, logit_rows, chunk_logits, failed_chunks)
            self._keep_last_logits(computed, chunk_logits)
        results = []
        drawn = self._draw_plain_argmax(plan, chunk_logits, failed_chunks)
        for chunk in plan.chunks:
            if chunk.request_id in drawn:
                results.append(drawn[chunk.request_id])
            elif chunk.request_id in failed_chunks:
                results.append(ChunkResult(request_id=chunk.request_id, sampled=None, error=failed_chunks[chunk.request_id]))
            elif chunk.token_ids:
                results.append(self._chunk_result(chunk, chunk_logits[chunk.request_id]))
            else:
                results.append(self._chunk_result(chunk, self.last_logits[chunk.slot : chunk.slot + 1]))
        self._hint_next_rows(plan, results)
        return StepResult(chunks=tuple(results))

    def _graph_rows(self, computed: list) -> list[DecodeRow] | None:
        """The step as decode rows when a captured graph can run it (one token per chunk, a bucket
        that holds it), else None."""
        if self.graphs is None or any(len(c.token_ids) != 1 for c in computed):
            return None
        rows = [DecodeRow(c.slot, c.token_ids[0], c.position, c.pages) for c in computed]
        return rows if self.graphs.fits(rows) else None

    def _replay(self, rows: list[DecodeRow], computed: list, logit_rows: list[list[int]], chunk_logits: dict,
                failed_chunks: dict) -> None:
        """The decode graph over the step; fills each chunk's logits and Engram errors, as `_forward`."""
        logits = self.graphs.run(rows)
        failed = self._engram_failures(len(rows))
        for index, (chunk, wanted) in enumerate(zip(computed, logit_rows)):
            chunk_logits[chunk.request_id] = logits[index : index + len(wanted)]
            if index in failed:
                failed_chunks[chunk.request_id] = failed[index]

    def _forward(self, computed: list, logit_rows: list[list[int]], chunk_logits: dict, failed_chunks: dict) -> None:
        """The eager forward over the flat batch of chunks; fills each chunk's logits and Engram errors."""
        batch = ForwardBatch.build(
            [(c.slot, list(c.token_ids), c.position, list(c.pages)) for c in computed], logits=logit_rows
        )
        n_rows = sum(len(rows) for rows in logit_rows)
        out = self.logits[:n_rows] if n_rows <= self.logits.shape[0] else None
        with BatchInvariantMode() if self.deterministic else nullcontext():
            logits = self.model(batch, self.cache, out=out)
        failed = self._engram_failures(batch.token_ids.shape[0])
        offset = 0
        for chunk, rows, batch_chunk in zip(computed, logit_rows, batch.chunks):
            chunk_logits[chunk.request_id] = logits[offset : offset + len(rows)]
            offset += len(rows)
            span = range(batch_chunk.start, batch_chunk.start + batch_chunk.length)
            error = next((failed[r] for r in span if r in failed), None)
            if error is not None:
                failed_chunks[chunk.request_id] = error

    @staticmethod
    def _draw_plain_argmax(plan: StepPlan, chunk_logits: dict, failed_chunks: dict) -> dict[str, ChunkResult]:
        """The results of computed chunks that only draw a plain greedy token (the common decode row),
        drawn in one batch."""
        plain = [c for c in plan.chunks if c.token_ids and c.sample and not c.logprob_targets
                 and c.request_id not in failed_chunks and draws_plain_argmax(c.params, c.num_generated)]
        if not plain:
            return {}
        rows = torch.stack([chunk_logits[c.request_id][-1] for c in plain])
        return {c.request_id: ChunkResult(request_id=c.request_id, sampled=token)
                for c, token in zip(plain, argmax_rows(rows))}

    def _keep_last_logits(self, computed: list, chunk_logits: dict[str, torch.Tensor]) -> None:
        if self.last_logits is None:
            return
        sampling = [c for c in computed if c.sample]
        if sampling:
            slots = torch.tensor([c.slot for c in sampling], device=self.last_logits.device)
            self.last_logits[slots] = torch.stack([chunk_logits[c.request_id][-1] for c in sampling])

    def _copy_prefix_state(self, plan: StepPlan) -> None:
        """Snapshots first (they read slots as the last step left them), then restores, then pages."""
        for copies in (plan.saves, plan.restores):
            sources, targets = [c.source for c in copies], [c.target for c in copies]
            self.cache.copy_slots(sources, targets)
            if copies and self.last_logits is not None:
                self.last_logits[targets] = self.last_logits[sources]
        self.cache.copy_pages([s for s, _ in plan.page_copies], [t for _, t in plan.page_copies])

    def _engram_failures(self, num_tokens: int) -> dict[int, str]:
        """Tokens (flat batch rows) whose Engram rows could not be read. Each rank reads only its
        heads' rows, so with several ranks the flags are summed over the group: every rank then fails
        the same requests, whichever rank's read broke."""
        memory = getattr(self.model, "engram_memory", None)
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
        memory = getattr(self.model, "engram_memory", None)
        source = getattr(memory, "source", None)
        if not getattr(source, "reads_disk", False):  # every row resident: nothing to read ahead
            return
        sampled = [(chunk, result.sampled.token_id) for chunk, result in zip(plan.chunks, results) if result.sampled]
        if not sampled:
            return
        slots = torch.tensor([chunk.slot for chunk, _ in sampled])
        contexts = self.cache.engram_context[slots.to(self.cache.engram_context.device)].cpu().numpy()
        ids = memory.next_row_ids(np.array([token for _, token in sampled]), contexts)  # this rank's rows
        source.hint([chunk.request_id for chunk, _ in sampled], ids)  # one hint a step

    # -- the rest of the ModelExecutor protocol (contract/executor.py) ------------------------------
    def engram_stats(self) -> EngramStats | None:
        """The Engram store's counters (None without a tiered store)."""
        stats = getattr(getattr(getattr(self.model, "engram_memory", None), "source", None), "stats", None)
        return None if stats is None else stats.snapshot()

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its pending Engram prefetches are dropped."""
        memory = getattr(self.model, "engram_memory", None)
        cancel = getattr(getattr(memory, "source", None), "cancel", None)
        if cancel is not None:
            cancel(request_id)

    def maintain(self) -> None:
        """One runner has nothing to repair between steps."""

    def health(self) -> str | None:
        return None

    def close(self) -> None:
        """The runner starts no processes; its memory goes with it."""

    @staticmethod
    def _rows_wanted(chunk) -> list[int]:
        rows = list(range(len(chunk.logprob_targets)))
        if chunk.sample and (not rows or rows[-1] != len(chunk.token_ids) - 1):
            rows.append(len(chunk.token_ids) - 1)
        return rows

    @staticmethod
    def _chunk_result(chunk, logits: torch.Tensor) -> ChunkResult:
        top_n = chunk.params.prompt_logprobs
        prompt = tuple(
            token_logprobs(torch.log_softmax(logits[i], -1), target, top_n)
            for i, target in enumerate(chunk.logprob_targets)
        )
        sampled = sample(logits[-1], chunk.params, chunk.num_generated, chunk.prompt_token_ids, chunk.output_token_ids) if chunk.sample else None
        return ChunkResult(request_id=chunk.request_id, sampled=sampled, prompt_logprobs=prompt)
