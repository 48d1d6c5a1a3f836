"""Continuous batching policy: which requests run which tokens in the next step.

Pure Python over ids and integers (no torch). Every step takes one decode token from each running
request whose prompt is done, then prompt chunks of partly prefilled requests, then admits waiting
requests while cache slots and the step's token budget last; long prompts are prefilled in chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.plan import ScheduledChunk, StepPlan, StepResult
from scheduler.request import Request, RequestOutput, RequestStatus, TokenLogprob


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class RequestRejected(ValueError):
    """A request the engine will not run; the message is meant for the client (HTTP 400)."""


class Scheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(limits.max_num_seqs - 1, -1, -1))
        self.pending_prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}

    def validate(self, request: Request) -> None:
        limits, prompt = self.limits, request.prompt_token_ids
        if not prompt:
            raise RequestRejected("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
        if len(prompt) + request.params.max_tokens > limits.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {limits.max_model_len} tokens; the request has "
                f"{len(prompt)} prompt tokens and asks for {request.params.max_tokens} more"
            )

    def add(self, request: Request) -> None:
        self.validate(request)
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        for request in list(self.waiting) + self.running:
            if request.request_id == request_id:
                return self._finish(request, RequestStatus.ABORTED, "abort")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.limits.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in [r for r in self.running if not r.in_prefill] + [r for r in self.running if r.in_prefill]:
            if budget <= 0:
                break
            chunk = self._chunk(request, budget)
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
        while self.waiting and self.free_slots and budget > 0:
            request = self.waiting.popleft()
            request.slot, request.status = self.free_slots.pop(), RequestStatus.RUNNING
            self.running.append(request)
            chunk = self._chunk(request, budget)
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
        return StepPlan(chunks=tuple(chunks))

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        tokens = request.all_token_ids
        start = request.num_computed_tokens
        end = min(len(tokens), start + budget)
        prompt_len = len(request.prompt_token_ids)
        wants_prompt_logprobs = request.params.prompt_logprobs is not None and start < prompt_len
        targets = tuple(tokens[start + 1 : min(end + 1, prompt_len)]) if wants_prompt_logprobs else ()
        return ScheduledChunk(
            request_id=request.request_id,
            slot=request.slot,
            token_ids=tuple(tokens[start:end]),
            position=start,
            sample=end == len(tokens),
            logprob_targets=targets,
            params=request.params,
            num_generated=len(request.output_token_ids),
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Applies a step's results; returns one output per request that changed."""
        by_id = {r.request_id: r for r in self.running}
        outputs = []
        for chunk, chunk_result in zip(plan.chunks, result.chunks, strict=True):
            request = by_id.get(chunk.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            if chunk.params.prompt_logprobs is not None and chunk.position < len(request.prompt_token_ids):
                collected = self.pending_prompt_logprobs.setdefault(request.request_id, [None])
                collected.extend(chunk_result.prompt_logprobs)
            if chunk_result.sampled is not None:
                outputs.append(self._append_token(request, chunk_result.sampled))
        return outputs

    def _append_token(self, request: Request, sampled: TokenLogprob) -> RequestOutput:
        request.output_token_ids.append(sampled.token_id)
        prompt_logprobs = self.pending_prompt_logprobs.pop(request.request_id, None)
        reason = self._stop_reason(request, sampled.token_id)
        logprobs = (sampled,) if request.params.logprobs is not None else ()
        if reason is not None:
            self._release(request, RequestStatus.FINISHED, reason)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=(sampled.token_id,),
            new_logprobs=logprobs,
            prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs is not None else None,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in self.limits.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if len(request.all_token_ids) >= self.limits.max_model_len:
            return "length"
        return None

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The step failed: every running request ends with the error; waiting ones stay queued."""
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
        )

    def _release(self, request: Request, status: RequestStatus, reason: str) -> None:
        request.status, request.finish_reason = status, reason
        if request in self.running:
            self.running.remove(request)
            self.free_slots.append(request.slot)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.slot = None

    def check_integrity(self) -> None:
        """Slots: every slot is either free or held by exactly one running request."""
        held = [r.slot for r in self.running]
        assert len(set(held)) == len(held), "a slot is held twice"
        assert sorted(held + self.free_slots) == list(range(self.limits.max_num_seqs)), "slots leaked"
