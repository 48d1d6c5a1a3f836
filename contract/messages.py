"""The messages between the front end and the engine process (contract/codec.py puts them on the wire).

Front end -> engine: a NewRequest, an Abort (a request id), CheckGrammar (compile a request's output
constraint before the request is made, so a bad one is the client's 400), Shutdown. Engine -> front
end: EngineReady (once, after the model loaded), StepOutputs (one per step), EngineStats (when they
change), GrammarChecked (a CheckGrammar's answer), EngineFailed (the engine cannot go on; its process
exits after sending it).
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.limits import EngineLimits
from contract.requests import NewRequest, RequestOutput
from contract.stats import EngineStats
from contract.structured import StructuredOutput


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class CheckGrammar:
    """Compile `structured` (the engine keeps the result in its cache for the request that follows)."""

    check_id: str
    structured: StructuredOutput


@dataclass(frozen=True)
class GrammarChecked:
    check_id: str
    error: str | None  # None: it compiled; else why not, for the client


@dataclass(frozen=True)
class Shutdown:
    """Stop the loop and exit; in-flight requests are dropped (the front end has drained them)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the front end needs to know of the loaded model, so it never reads the checkpoint's config
    itself: the chat format and the tokenizer's bos depend on these."""

    model_type: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class EngineReady:
    """The loaded engine's limits (the front end validates requests against the same numbers), its
    device and dtype, and the model facts."""

    limits: EngineLimits
    device: str
    dtype: str
    model: ModelFacts

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


@dataclass(frozen=True)
class EngineFailed:
    error: str


@dataclass(frozen=True)
class StepOutputs:
    """Everything one engine step produced for its requests: one frame per step, not per request."""

    outputs: tuple[RequestOutput, ...]


ToEngine = NewRequest | Abort | CheckGrammar | Shutdown
FromEngine = EngineReady | StepOutputs | EngineStats | GrammarChecked | EngineFailed
