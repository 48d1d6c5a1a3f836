"""Builds the engine (model, runner, scheduler) from a validated server config.

The one place that turns config sections into engine objects; the engine process calls it (today the
HTTP process, on a thread). Front-end code never imports the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from models import ModelConfig, load_model
from scheduler import EngineCore, RequestOutput, Scheduler, SchedulerLimits
from worker.runner import ModelRunner

if TYPE_CHECKING:
    from server.config import ServeConfig

log = logging.getLogger("ds4serve.engine")


@dataclass(frozen=True)
class EngineSpec:
    """What the front end needs to know about the engine it talks to."""

    max_model_len: int
    device: str
    dtype: str


def resolve_device(config: "ServeConfig") -> str:
    wanted = config.runtime.device
    return "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"


def resolve_dtype(config: "ServeConfig", device: str) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, config.model.dtype)


def max_model_len(config: "ServeConfig", model_config: ModelConfig) -> int:
    return config.model.max_model_len or model_config.max_position_embeddings


def build_engine_core(config: "ServeConfig", on_output: Callable[[RequestOutput], None]) -> tuple[EngineCore, EngineSpec]:
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    model_dir = config.model_dir
    model_config = ModelConfig.from_file(model_dir / "config.json")
    max_len = max_model_len(config, model_config)
    model = load_model(model_dir, dtype=dtype, device=device)
    runner = ModelRunner(model, config.scheduler.max_num_seqs, max_len, device=device)
    limits = SchedulerLimits(
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=max_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=model_config.eos_token_ids,
    )
    engine = EngineCore(Scheduler(limits), runner, on_output)
    log.info("engine for %s on %s (%s)", model_dir, device, dtype)
    return engine, EngineSpec(max_model_len=max_len, device=device, dtype=str(dtype).removeprefix("torch."))
