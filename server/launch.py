"""Wires a validated config into a running engine process and the HTTP app.

This process tokenizes and serves HTTP; the engine (model, runner, scheduler) is built inside its own
process (server/engine_process.py), and the HTTP code only sees the EngineClient.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI

from server.app import ServedModel, create_app
from server.chat import ChatFormat
from server.config import DEFAULT_MODEL_DIR, ServeConfig
from server.engine_client import EngineClient
from server.metrics import MetricsSetup, install_metrics
from server.tokenizer import TextTokenizer

log = logging.getLogger("ds4serve.launch")


def ensure_default_model(model_dir: Path) -> None:
    if model_dir == DEFAULT_MODEL_DIR and not (model_dir / "config.json").exists():
        from models.tiny import build_tiny_checkpoint

        log.info("building the tiny default checkpoint in %s", model_dir)
        build_tiny_checkpoint(model_dir)


def build_server(config: ServeConfig, api_key: str | None = None) -> FastAPI:
    """Raises EngineStartError (a ValueError) when the engine process cannot start."""
    from models import ModelConfig
    from server.engine_process import EngineProcess

    model_dir = config.model_dir
    ensure_default_model(model_dir)
    model_config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = TextTokenizer(model_dir, model_config.bos_token_id)
    client = EngineClient()
    engine = EngineProcess(config, client)
    client.connect(engine)
    limits = engine.ready.limits
    served = ServedModel(config.served_model_name, str(model_dir), limits.max_model_len, limits.max_num_seqs)
    chat = ChatFormat.for_checkpoint(model_dir, model_config.model_type)
    app = create_app(client, tokenizer, served, config.api_keys(api_key), settings=config.server, chat=chat)
    metrics = MetricsSetup(served.name, served.max_model_len, config.scheduler.block_tokens, config.metrics.vllm_compat)
    install_metrics(app, client, metrics)
    app.router.on_shutdown.append(engine.stop)
    log.info("serving %s (%s, %s) as %r", model_dir, engine.ready.device, engine.ready.dtype, served.name)
    return app
