"""How a request draws its tokens, and what a drawn token reports: crosses the HTTP -> engine -> worker
boundaries unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from contract.structured import StructuredOutput

# vLLM's ranges (vllm/sampling_params.py): below MIN_TEMPERATURE a positive temperature divides the
# logits into inf / NaN in float32, so the HTTP layer raises it to MIN_TEMPERATURE as vLLM does
# (server/protocol.py) and the engine refuses it; 0 is greedy.
MIN_TEMPERATURE = 1e-2
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI and vLLM bound them
# vLLM asks only > 0. The penalty divides or multiplies a logit, so p and 1/p are equally strong; past
# these bounds (far beyond any useful value) the penalized logits of float32 overflow to inf, or a
# penalty rounds to 0 or inf and 0 * inf makes NaN, which would poison the request's draw.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI bounds it


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
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these ids can be drawn (vLLM's field)
    # vLLM's bad_words as token id sequences: a word's last id is banned whenever the output ends with
    # the ids before it (a one-id word is banned always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None  # the output's grammar (engine/structured_outputs.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_prompt(self) -> bool:
        """The sampler needs the prompt's token ids (repetition penalty)."""
        return self.repetition_penalty != 1.0

    @property
    def penalizes_output(self) -> bool:
        """The sampler needs the output's token ids (any penalty, or a bad word of several ids: the
        scheduler fills the histories only then)."""
        return (self.penalizes_prompt or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or any(len(word) > 1 for word in self.bad_words))

    def bad_word_bans(self, output_token_ids: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The ids bad_words ban after `output_token_ids`: each word's last id where the output ends with
        the rest of the word."""
        bans = []
        for word in self.bad_words:
            head = word[:-1]
            if not head or tuple(output_token_ids[len(output_token_ids) - len(head):]) == head:
                bans.append(word[-1])
        return tuple(bans)

    def banned_at(self, draw_index: int) -> tuple[int, ...]:
        """The ids the draw at `draw_index` (output tokens before it) may not take: stop_token_ids
        until min_tokens tokens are out (`for_draw` adds the eos ids while that holds)."""
        return self.stop_token_ids if draw_index < self.min_tokens else ()

    def reshapes_at(self, draw_index: int) -> bool:
        """Something changes the logits the draw at `draw_index` sees (logit_bias, the min_tokens ban, a
        penalty, allowed_token_ids, bad_words, a grammar). The one place that lists it: a new sampling
        field that reshapes the draw joins it here. A method rather than a property because the ban
        depends on the draw index, and a multi-token step draws several indices of one request."""
        return bool(self.logit_bias or self.banned_at(draw_index) or self.penalizes_output or self.allowed_token_ids
                    or self.bad_words or self.structured is not None)

    def plain_at(self, draw_index: int) -> bool:
        """The draw at `draw_index` is plain: the raw logits' argmax with only its own logprob to report
        (greedy; nothing reshapes the logits; no top logprobs). A step whose rows are all plain is one
        argmax (worker/sampler.py)."""
        return self.greedy and not (self.reshapes_at(draw_index) or self.logprobs)

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidSamplingParams for a request the sampler cannot run: a float outside vLLM's
        range (non-finite ones included: they reach the sampler as NaN logits), ids outside the
        vocabulary, min_tokens past max_tokens. The HTTP schema checks the ranges first; this is the
        engine boundary's check, whoever builds the params."""
        self._validate_ranges()
        checked = (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                   ("allowed_token_ids", self.allowed_token_ids), ("bad_words", [t for w in self.bad_words for t in w]))
        for param, ids in checked:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidSamplingParams(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param)
        for param, count in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if count is not None and not 0 <= count <= vocab_size:
                raise InvalidSamplingParams(f"{param} must be between 0 and the vocabulary size {vocab_size}, got {count}", param)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens ({self.min_tokens}) must be between 0 and max_tokens ({self.max_tokens})", "min_tokens"
            )

    def _validate_ranges(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise InvalidSamplingParams(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {self.temperature}",
                "temperature",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be 0 (no filter) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        low, high = PENALTY_RANGE
        for param, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not low <= value <= high:
                raise InvalidSamplingParams(f"{param} must be in [{low}, {high}], got {value}", param)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidSamplingParams(
                f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}", "repetition_penalty"
            )
        bad_bias = [(t, b) for t, b in self.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS]
        if bad_bias:
            token, bias = bad_bias[0]
            raise InvalidSamplingParams(
                f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                "logit_bias",
            )

    def for_draw(self, num_generated: int, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """The params the sampler sees for the next draw. The sampler bans stop_token_ids until min_tokens
        is reached; the eos ids (which also end the request unless ignored) join them only then, so the
        sampler needs no model config and requests past min_tokens are passed as they are."""
        if num_generated >= self.min_tokens or self.ignore_eos or not eos_token_ids:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + eos_token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
