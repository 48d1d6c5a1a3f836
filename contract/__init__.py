"""Everything that crosses a process or folder boundary: requests and their limits, sampling params,
step plans and results, engine messages and their wire codec, stats, the config schema.

The bottom of the project: imports no other project package (import-linter checks it), so any
folder may import it, and the HTTP process can talk to the engine without loading torch.
"""

from contract.executor import ModelExecutor
from contract.limits import EngineLimits, RequestRejected, validate_request
from contract.messages import Abort, EngineFailed, EngineReady, ModelFacts, Shutdown, StepOutputs
from contract.requests import NewRequest, RequestOutput
from contract.sampling import InvalidSamplingParams, SamplingParams, TokenLogprob
from contract.stats import PREFETCH_WAIT_BUCKETS, EngineStats, EngramStats
from contract.step import ChunkResult, ScheduledChunk, StateCopy, StepPlan, StepResult

__all__ = [
    "PREFETCH_WAIT_BUCKETS",
    "Abort",
    "ChunkResult",
    "EngineFailed",
    "EngineLimits",
    "EngineReady",
    "EngineStats",
    "EngramStats",
    "InvalidSamplingParams",
    "ModelExecutor",
    "ModelFacts",
    "NewRequest",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "ScheduledChunk",
    "Shutdown",
    "StateCopy",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "TokenLogprob",
    "validate_request",
]
