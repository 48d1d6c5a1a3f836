"""A new request as the front end sends it, and what each step reports back for it."""

from __future__ import annotations

from dataclasses import dataclass

from contract.sampling import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class NewRequest:
    """Everything the engine needs to run one request, frozen: the front end validates and sends it once;
    the scheduler keeps its own mutable state (scheduler/request.py) beside it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None  # prefix-cache tenant: requests only reuse state of the same salt
    # a position where a later request is likely to diverge (the chat layer: before the generation
    # prompt); the prefix cache keeps a state point there
    cache_boundary: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple):  # callers may pass a list; the message stays immutable
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))


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
    # Durations the engine measures on its own clock (a monotonic clock is not comparable across
    # processes, so the front end never subtracts engine timestamps): the seconds from the request's
    # arrival at the engine to its first scheduling, on the output with its first tokens; and the
    # seconds from its first scheduling to this output's tokens, on every output that carries tokens.
    queue_time_s: float | None = None
    inference_time_s: float | None = None
