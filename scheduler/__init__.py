"""Engine core policy: request state machine and continuous batching (pure Python, no torch)."""

from scheduler.engine_core import EngineCore, EngineStats, ModelExecutor
from scheduler.plan import ChunkResult, ScheduledChunk, StepPlan, StepResult
from scheduler.request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprob
from scheduler.scheduler import RequestRejected, Scheduler, SchedulerLimits, validate_request

__all__ = [
    "ChunkResult",
    "EngineCore",
    "EngineStats",
    "ModelExecutor",
    "Request",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerLimits",
    "StepPlan",
    "StepResult",
    "TokenLogprob",
    "validate_request",
]
