"""OpenAI protocol models (the part this server implements, with vLLM's extras), in pydantic.

Integers that travel to the engine are bounded here: its wire format (orjson) holds 64-bit integers
only, and a value it cannot encode must be the client's 400, not a 500. Non-finite floats are refused
for the same reason (JSON has none, but Python's parser accepts `NaN` and `Infinity`). Sampling floats
keep vLLM's ranges (contract/sampling.py, which the engine checks again), so no value reaches the
sampler as NaN logits: a positive temperature below MIN_TEMPERATURE is raised to it, as vLLM does.

Flags, token ids and `logprobs` are strict, as vLLM's fields are: `stream: "yes"`, `tokens: [true]` or
`logprobs: false` is a 400 naming the field, not quietly read as true / 1 / 0.

A vLLM field declared here does what vLLM's does; the vLLM fields this server does not implement are
refused with a 400 naming them (server/unsupported_fields.py); fields vLLM does not have are tolerated.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from contract.sampling import (
    MAX_LOGIT_BIAS,
    MIN_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
)

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's default max_logprobs)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: every chunk carries the usage so far


class SamplingFields(BaseModel):
    """What completions and chat completions share: sampling, stop conditions, streaming, extras."""

    # Unknown fields are tolerated, as OpenAI-compatible servers do: clients send vendor extras.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name; wins over max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    presence_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    # keys are token ids as strings (JSON object keys), as OpenAI sends them
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    min_tokens: int = Field(default=0, ge=0)
    return_token_ids: StrictBool = False
    # vLLM: requests only reuse prefix-cache state of requests with the same salt (tenants never share)
    cache_salt: str | None = Field(default=None, min_length=1)
    user: str | None = None
    # vLLM's extras (declared after n and stream, which their checks read)
    best_of: StrictInt | None = Field(default=None, ge=1)  # only n itself: every choice drawn is returned
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1, le=INT64_MAX)  # keep the last k
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top-k per prompt token
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # decoding never puts spaces around special tokens (nor does vLLM's with a fast tokenizer), so no value
    # changes the text
    spaces_between_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>"

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_raised(cls, temperature: float) -> float:
        """vLLM's rule: 0 < temperature < MIN_TEMPERATURE runs at MIN_TEMPERATURE (dividing the logits
        by less overflows float32); 0 stays greedy."""
        return MIN_TEMPERATURE if 0.0 < temperature < MIN_TEMPERATURE else temperature

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        """best_of > n would draw choices to throw away (vLLM's current API has no best_of either);
        best_of = n is just n."""
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported: every choice drawn is returned")
        return best_of

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_keeps_a_token(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be -1 (as many tokens as fit) or at least 1")
        return keep

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_are_not_streamed(cls, top: int | None, info: ValidationInfo) -> int | None:
        """vLLM refuses them with stream=true too: a stream has no place for them."""
        if top is not None and info.data.get("stream"):
            raise ValueError("not available with stream=true")
        return top

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def output_limit(self) -> int | None:
        """The requested output length (None: up to the context length)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def sample_logprobs(self) -> int | None:
        """Top alternatives to report per sampled token (None: no logprobs)."""
        raise NotImplementedError

    @property
    def echo_logprobs(self) -> int | None:
        """Top alternatives per prompt token in the echoed logprobs (None: none are echoed)."""
        return None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes per prompt token: enough for the echo and for prompt_logprobs."""
        return max((k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None), default=None)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: StrictBool = True  # a text prompt starts with the BOS (token ids are taken as they are)

    @property
    def sample_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


# vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it), else the
# token and its top alternatives by id, each {"logprob", "rank", "decoded_token"} (server/logprobs.py)
PromptLogprobs = list[dict[int, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChunk(BaseModel):
    """One SSE frame of a streamed completion (same `object` as the whole response, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] | list[list[int]] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ds4serve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (rendered by the chat template first).
    Unknown fields are kept: the chat renderer reads its own options (tools, template kwargs)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None  # None: True for a prompt, False for messages (the template adds BOS)
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()
