"""Wires a validated config into a running engine process and the HTTP app.

This process tokenizes and serves HTTP; the engine (model, runner, scheduler) is built inside its own
process (server/engine_process.py), and the HTTP code only sees the EngineClient.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from contract.config import ServeConfig
from server.app import ServedModel, create_app
from server.chat import ChatFormat
from server.engine_client import EngineClient
from server.engine_supervisor import EngineSupervisor
from server.metrics import MetricsSetup, install_metrics
from server.tokenizer import TextTokenizer

log = logging.getLogger("ds4serve.launch")


class EngineLost:
    """Set, from any thread, when the engine cannot be kept running (its restart budget is spent):
    the server then shuts down and exits non-zero (server/draining.py reads it)."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        log.error("giving up on the engine: %s", reason)
        self.reason = reason


def build_server(config: ServeConfig, api_key: str | None = None) -> FastAPI:
    """Raises EngineStartError (a ValueError) when the engine process cannot start. The engine starts
    first (it builds the embedded default model if needed) and reports the model facts the tokenizer
    and chat format need, so this process never reads the checkpoint's config itself."""
    model_dir = config.model_dir
    client = EngineClient()
    engine_lost = EngineLost()
    engine = EngineSupervisor(config, client, give_up=engine_lost.set)
    client.connect(engine)
    facts, limits = engine.ready.model, engine.ready.limits
    tokenizer = TextTokenizer(model_dir, facts.bos_token_id, max_tokens=limits.max_model_len)
    served = ServedModel(config.served_model_name, str(model_dir), limits.max_model_len, limits.max_num_seqs)
    chat = ChatFormat.for_checkpoint(model_dir, facts.model_type)
    app = create_app(client, tokenizer, served, config.api_keys(api_key), settings=config.server, chat=chat)
    metrics = MetricsSetup(served.name, served.max_model_len, config.scheduler.block_tokens, config.metrics.vllm_compat)
    install_metrics(app, client, metrics)
    app.router.on_shutdown.append(engine.stop)
    app.state.engine_lost = engine_lost
    log.info("serving %s (%s, %s) as %r", model_dir, engine.ready.device, engine.ready.dtype, served.name)
    return app
