"""Model runner: turns a StepPlan into a forward over the flat batch, then samples."""

from __future__ import annotations

import torch

from models import DeepseekV4, ForwardBatch, ModelCache
from scheduler.plan import ChunkResult, StepPlan, StepResult
from worker.sampler import sample, token_logprobs


class ModelRunner:
    """Owns the model and its per-slot cache; `execute` is the whole step of one worker."""

    def __init__(self, model: DeepseekV4, num_slots: int, max_model_len: int, device: str = "cpu") -> None:
        self.model = model
        dtype = model.lm_head.weight.dtype
        self.cache = ModelCache.allocate(model.config, num_slots, max_model_len, dtype=dtype, device=device)
        self.device = device

    def execute(self, plan: StepPlan) -> StepResult:
        logit_rows = [self._rows_wanted(chunk) for chunk in plan.chunks]
        batch = ForwardBatch.build(
            [(c.slot, list(c.token_ids), c.position) for c in plan.chunks], logits=logit_rows
        )
        logits = self.model(batch, self.cache)
        results, offset = [], 0
        for chunk, rows in zip(plan.chunks, logit_rows):
            chunk_logits = logits[offset : offset + len(rows)]
            offset += len(rows)
            results.append(self._chunk_result(chunk, chunk_logits))
        return StepResult(chunks=tuple(results))

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
        sampled = sample(logits[-1], chunk.params, chunk.num_generated) if chunk.sample else None
        return ChunkResult(request_id=chunk.request_id, sampled=sampled, prompt_logprobs=prompt)
