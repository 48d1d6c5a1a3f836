"""Engine policy: request state machine, continuous batching, block manager, prefix cache (pure
Python over ids and integers: no torch, no model)."""

from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = ["Request", "RequestStatus", "Scheduler"]
