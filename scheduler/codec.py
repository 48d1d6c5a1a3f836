"""The wire schema between the front end and the engine process: one orjson frame per message.

A frame is `[kind, body]`. Front end -> engine: "add" (a new Request: id, prompt and sampling params;
engine-side state never travels), "abort" (a request id), "shutdown". Engine -> front end: "ready"
(once, after the model loaded), "output" (a RequestOutput), "stats" (EngineStats), "failed" (the
engine cannot go on; its process exits after sending it). orjson writes dataclasses as objects and
tuples as arrays; the decoders below rebuild them. orjson also writes non-finite floats as null: the
only one a logprob holds is -inf, so a null logprob reads back as -inf.

Step plans travel the same way from tensor-parallel rank 0 to the other ranks (`encode_plan` /
`decode_plan`): one orjson object per step, no pickling on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from scheduler.engine_core import EngineStats
from scheduler.plan import ScheduledChunk, StateCopy, StepPlan
from scheduler.request import Request, RequestOutput, SamplingParams, TokenLogprob
from scheduler.scheduler import SchedulerLimits


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Stop the loop and exit; in-flight requests are dropped (the front end has drained them)."""


@dataclass(frozen=True)
class EngineReady:
    """The loaded engine's limits: the front end validates requests against the same numbers."""

    limits: SchedulerLimits
    device: str
    dtype: str

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


@dataclass(frozen=True)
class EngineFailed:
    error: str


ToEngine = Request | Abort | Shutdown
FromEngine = EngineReady | RequestOutput | EngineStats | EngineFailed


def encode(message: ToEngine | FromEngine) -> bytes:
    if isinstance(message, Request):
        body: Any = {
            "request_id": message.request_id, "prompt_token_ids": message.prompt_token_ids, "params": message.params,
            "cache_salt": message.cache_salt, "cache_boundary": message.cache_boundary,
        }
    else:
        body = message
    return orjson.dumps([_KINDS[type(message)], body])


def decode(frame: bytes) -> ToEngine | FromEngine:
    kind, body = orjson.loads(frame)
    return _DECODERS[kind](body)


def _tuples(value: Any) -> Any:
    """Arrays back to tuples, nested ones too: every sequence field of a frozen message is a tuple."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    return {name: _tuples(value) for name, value in body.items()}


def _logprob(value: float | None) -> float:
    return -math.inf if value is None else value


def _token_logprob(body: dict[str, Any]) -> TokenLogprob:
    top = tuple((token, _logprob(logprob)) for token, logprob in body["top"])
    return TokenLogprob(token_id=body["token_id"], logprob=_logprob(body["logprob"]), top=top)


def _request(body: dict[str, Any]) -> Request:
    return Request(
        body["request_id"], list(body["prompt_token_ids"]), SamplingParams(**_fields(body["params"])),
        cache_salt=body["cache_salt"], cache_boundary=body["cache_boundary"],
    )


def _output(body: dict[str, Any]) -> RequestOutput:
    prompt = body["prompt_logprobs"]
    return RequestOutput(**{
        **body,
        "new_token_ids": tuple(body["new_token_ids"]),
        "new_logprobs": tuple(_token_logprob(entry) for entry in body["new_logprobs"]),
        "prompt_logprobs": None if prompt is None else tuple(e if e is None else _token_logprob(e) for e in prompt),
    })


def _ready(body: dict[str, Any]) -> EngineReady:
    return EngineReady(limits=SchedulerLimits(**_fields(body["limits"])), device=body["device"], dtype=body["dtype"])


_KINDS: dict[type, str] = {
    Request: "add",
    Abort: "abort",
    Shutdown: "shutdown",
    EngineReady: "ready",
    RequestOutput: "output",
    EngineStats: "stats",
    EngineFailed: "failed",
}
_DECODERS: dict[str, Callable[[dict[str, Any]], ToEngine | FromEngine]] = {
    "add": _request,
    "abort": lambda body: Abort(**body),
    "shutdown": lambda body: Shutdown(),
    "ready": _ready,
    "output": _output,
    "stats": lambda body: EngineStats(**{**body, "engram_wait_buckets": tuple(body.get("engram_wait_buckets", ()))}),
    "failed": lambda body: EngineFailed(**body),
}


def encode_plan(plan: StepPlan) -> bytes:
    return orjson.dumps(plan)


def decode_plan(frame: bytes) -> StepPlan:
    body = orjson.loads(frame)
    chunks = tuple(
        ScheduledChunk(**{**_fields(chunk), "params": SamplingParams(**_fields(chunk["params"]))})
        for chunk in body["chunks"]
    )
    return StepPlan(
        chunks=chunks,
        saves=tuple(StateCopy(**copy) for copy in body["saves"]),
        restores=tuple(StateCopy(**copy) for copy in body["restores"]),
        page_copies=_tuples(body["page_copies"]),
    )
