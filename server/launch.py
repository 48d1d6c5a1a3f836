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
from server.engine_process import EngineProcess
from server.metrics import MetricsSetup, install_metrics
from server.tokenizer import TextTokenizer

log = logging.getLogger("ds4serve.launch")


def build_server(config: ServeConfig, api_key: str | None = None) -> FastAPI:
    """Raises EngineStartError (a ValueError) when the engine process cannot start. The engine starts
    first (it builds the embedded default model if needed) and reports the model facts the tokenizer
    and chat format need, so this process never reads the checkpoint's config itself."""
    model_dir = config.model_dir
    client = EngineClient()
    engine = EngineProcess(config, client)
    client.connect(engine)
    facts, limits = engine.ready.model, engine.ready.limits
    tokenizer = TextTokenizer(model_dir, facts.bos_token_id)
    served = ServedModel(config.served_model_name, str(model_dir), limits.max_model_len, limits.max_num_seqs)
    chat = ChatFormat.for_checkpoint(model_dir, facts.model_type)
    app = create_app(client, tokenizer, served, config.api_keys(api_key), settings=config.server, chat=chat)
    metrics = MetricsSetup(served.name, served.max_model_len, config.scheduler.block_tokens, config.metrics.vllm_compat)
    install_metrics(app, client, metrics)
    app.router.on_shutdown.append(engine.stop)
    log.info("serving %s (%s, %s) as %r", model_dir, engine.ready.device, engine.ready.dtype, served.name)
    return app
