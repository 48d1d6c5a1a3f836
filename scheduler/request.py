"""Requests as the engine sees them, and the plain messages that cross the engine boundary."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class InvalidSamplingParams(ValueError):
    """Sampling parameters the engine will not run; the message is meant for the client (HTTP 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens (vLLM / OpenAI semantics).

    Penalties, logit_bias and the min_tokens ban change what is drawn (greedy's argmax too); reported
    logprobs stay the model's own log-softmax.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top-N logprobs per generated token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # same for every prompt token (echo)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token already generated
    repetition_penalty: float = 1.0  # tokens of prompt + output: positive logits divided, negative multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # eos and stop_token_ids cannot be drawn before this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_prompt(self) -> bool:
        """The sampler needs the prompt's token ids (repetition penalty)."""
        return self.repetition_penalty != 1.0

    @property
    def penalizes_output(self) -> bool:
        """The sampler needs the output's token ids (any penalty)."""
        return self.penalizes_prompt or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidSamplingParams for what a schema cannot check: ids against the vocabulary, and
        min_tokens against max_tokens."""
        for param, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidSamplingParams(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens ({self.min_tokens}) must be between 0 and max_tokens ({self.max_tokens})", "min_tokens"
            )

    def for_draw(self, num_generated: int, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """The params the sampler sees for the next draw. The sampler bans stop_token_ids until min_tokens
        is reached; the eos ids (which also end the request unless ignored) join them only then, so the
        sampler needs no model config and requests past min_tokens are passed as they are."""
        if num_generated >= self.min_tokens or self.ignore_eos or not eos_token_ids:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + eos_token_ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of prompt + output already in the cache
    slot: int | None = None
    finish_reason: str | None = None
    cache_salt: str | None = None  # prefix-cache tenant: requests only reuse state of the same salt
    # a position where a later request is likely to diverge (the chat layer: before the generation
    # prompt); the prefix cache keeps a state point there
    cache_boundary: int | None = None
    num_cached_tokens: int = 0  # prompt tokens the first admission found in the prefix cache
    logits_position: int = -1  # computed tokens when the slot's last logits were produced

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request; the front end accumulates these."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first entry None (no context)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
