"""The wire format between the front end and the engine process: one orjson frame per message.

A frame is `[kind, body]` (contract/messages.py lists the messages). orjson writes dataclasses as
objects and tuples as arrays; the decoders below rebuild them. orjson also writes non-finite floats as
null: the only one a logprob holds is -inf, so a null logprob reads back as -inf.

Step plans travel the same way from tensor-parallel rank 0 to the other ranks (`encode_plan` /
`decode_plan`): one orjson object per step, no pickling on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import orjson

from contract.limits import EngineLimits, PrefixTierLimits
from contract.messages import (
    Abort,
    CheckGrammar,
    EngineFailed,
    EngineReady,
    FromEngine,
    GrammarChecked,
    ModelFacts,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from contract.requests import NewRequest, RequestOutput
from contract.sampling import SamplingParams, TokenLogprob
from contract.stats import EngineStats, EngramStats, ExpertOffloadStats, SpecDecodeCounts, StepTokens
from contract.step import ScheduledChunk, StateCopy, StepPlan, TierMove
from contract.structured import StructuredOutput


def encode(message: ToEngine | FromEngine) -> bytes:
    return orjson.dumps([_KINDS[type(message)], message])


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


def _params(body: dict[str, Any]) -> SamplingParams:
    structured = body["structured"]
    return SamplingParams(**{**_fields(body), "structured": None if structured is None else StructuredOutput(**structured)})


def _request(body: dict[str, Any]) -> NewRequest:
    return NewRequest(**{**_fields(body), "params": _params(body["params"])})


def _output(body: dict[str, Any]) -> RequestOutput:
    prompt = body["prompt_logprobs"]
    return RequestOutput(**{
        **body,
        "new_token_ids": tuple(body["new_token_ids"]),
        "new_logprobs": tuple(_token_logprob(entry) for entry in body["new_logprobs"]),
        "prompt_logprobs": None if prompt is None else tuple(e if e is None else _token_logprob(e) for e in prompt),
    })


def _ready(body: dict[str, Any]) -> EngineReady:
    limits = _fields(body["limits"])
    limits["prefix_tiers"] = PrefixTierLimits(**body["limits"]["prefix_tiers"])
    return EngineReady(limits=EngineLimits(**limits), device=body["device"], dtype=body["dtype"],
                       model=ModelFacts(**_fields(body["model"])))


def _stats(body: dict[str, Any]) -> EngineStats:
    engram, offload = body["engram"], body["offload"]
    return EngineStats(**{**body, "engram": None if engram is None else EngramStats(**_fields(engram)),
                          "offload": None if offload is None else ExpertOffloadStats(**offload),
                          "step_tokens": StepTokens(**_fields(body["step_tokens"])),
                          "spec": SpecDecodeCounts(**_fields(body["spec"]))})


_KINDS: dict[type, str] = {
    NewRequest: "add",
    Abort: "abort",
    Shutdown: "shutdown",
    CheckGrammar: "check_grammar",
    GrammarChecked: "grammar_checked",
    EngineReady: "ready",
    StepOutputs: "outputs",
    EngineStats: "stats",
    EngineFailed: "failed",
}
_DECODERS: dict[str, Callable[[Any], ToEngine | FromEngine]] = {
    "add": _request,
    "abort": lambda body: Abort(**body),
    "shutdown": lambda body: Shutdown(),
    "check_grammar": lambda body: CheckGrammar(body["check_id"], StructuredOutput(**body["structured"])),
    "grammar_checked": lambda body: GrammarChecked(**body),
    "ready": _ready,
    "outputs": lambda body: StepOutputs(tuple(_output(output) for output in body["outputs"])),
    "stats": _stats,
    "failed": lambda body: EngineFailed(**body),
}


def encode_plan(plan: StepPlan) -> bytes:
    return orjson.dumps(plan)


def decode_plan(frame: bytes) -> StepPlan:
    body = orjson.loads(frame)
    chunks = tuple(
        ScheduledChunk(**{**_fields(chunk), "params": _params(chunk["params"])})
        for chunk in body["chunks"]
    )
    return StepPlan(
        chunks=chunks,
        saves=tuple(StateCopy(**copy) for copy in body["saves"]),
        restores=tuple(StateCopy(**copy) for copy in body["restores"]),
        page_copies=_tuples(body["page_copies"]),
        tier_moves=tuple(TierMove(**_fields(move)) for move in body["tier_moves"]),
        tickets_out=body["tickets_out"],
        draw_seed=body["draw_seed"],
    )
