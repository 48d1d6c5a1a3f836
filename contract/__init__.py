"""Everything that crosses a process or folder boundary: requests and their limits, sampling params,
step plans and results, engine messages and their wire codec, stats, the config schema.

The bottom of the project: imports no other project package (import-linter checks it), so any
folder may import it, and the HTTP process can talk to the engine without loading torch.
"""

from contract.executor import DoneStep, LaunchedStep, ModelExecutor
from contract.limits import EngineLimits, PrefixTierLimits, RequestRejected, validate_request
from contract.messages import (
    Abort,
    CheckGrammar,
    EngineFailed,
    EngineReady,
    GrammarChecked,
    ModelFacts,
    Shutdown,
    StepOutputs,
)
from contract.requests import NewRequest, RequestOutput
from contract.sampling import InvalidSamplingParams, SamplingParams, TokenLogprob
from contract.stats import (
    PREFETCH_WAIT_BUCKETS,
    STEP_TOKEN_BUCKETS,
    EngineStats,
    EngramStats,
    ExpertOffloadStats,
    SpecDecodeCounts,
    StepTokens,
)
from contract.step import (
    PENDING_TOKEN,
    TIER_MOVES,
    ChunkResult,
    ScheduledChunk,
    StateCopy,
    StepPlan,
    StepResult,
    TierDone,
    TierMove,
)
from contract.structured import StructuredOutput

__all__ = [
    "PREFETCH_WAIT_BUCKETS",
    "STEP_TOKEN_BUCKETS",
    "TIER_MOVES",
    "PENDING_TOKEN",
    "DoneStep",
    "LaunchedStep",
    "Abort",
    "CheckGrammar",
    "ChunkResult",
    "EngineFailed",
    "EngineLimits",
    "EngineReady",
    "EngineStats",
    "EngramStats",
    "ExpertOffloadStats",
    "GrammarChecked",
    "InvalidSamplingParams",
    "ModelExecutor",
    "ModelFacts",
    "NewRequest",
    "PrefixTierLimits",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "ScheduledChunk",
    "Shutdown",
    "StateCopy",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "SpecDecodeCounts",
    "StepTokens",
    "StructuredOutput",
    "TierDone",
    "TierMove",
    "TokenLogprob",
    "validate_request",
]
