"""Wires a validated config into a running engine process and the HTTP app.

This process tokenizes and serves HTTP; the engine (model, runner, scheduler) is built inside its own
process (server/engine_process.py), and the HTTP code only sees the EngineClient.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from contract.config import ServeConfig
from contract.model_files import check_model_dir, tokenizer_dir
from server.app import ServedModel, create_app
from server.chat import ChatFormat
from server.chat_options import check_format_names, template_source
from server.engine_client import EngineClient
from server.engine_supervisor import EngineSupervisor
from server.metrics import MetricsSetup, install_metrics
from server.request_log import RequestLoggingClient
from server.startup_summary import ServingSummary
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
    """Raises EngineStartError (a ValueError) when the engine process cannot start, ConfigFileError when
    the chat options do not fit the model (the engine is stopped again then). The engine starts first
    and reports the model facts the tokenizer and chat format need, so this process never reads the
    checkpoint's config itself."""
    model_dir = config.model_dir
    check_model_dir(config)  # refused before anything loads
    template = template_source(config.chat.template)
    client = RequestLoggingClient() if config.server.log_requests else EngineClient()
    engine_lost = EngineLost()
    engine = EngineSupervisor(config, client, give_up=engine_lost.set)
    try:
        client.connect(engine)
        facts, limits = engine.ready.model, engine.ready.limits
        check_format_names(config.chat, facts.model_type)
        tokenizer = TextTokenizer(tokenizer_dir(config), facts.bos_token_id, max_tokens=limits.max_model_len)
        names = config.served_model_names
        served = ServedModel(names[0], str(model_dir), limits.max_model_len, limits.max_num_seqs, aliases=names[1:])
        chat = ChatFormat.for_checkpoint(tokenizer_dir(config), facts.model_type, template,
                                         config.chat.default_template_kwargs)
    except Exception:
        engine.stop()
        raise
    keys = config.api_keys(api_key)
    app = create_app(client, tokenizer, served, keys, settings=config.server, chat=chat)
    metrics = MetricsSetup(served.name, served.max_model_len, config.scheduler.block_tokens, config.metrics.vllm_compat)
    install_metrics(app, client, metrics)
    app.router.on_shutdown.append(engine.stop)
    app.state.engine_lost = engine_lost
    app.state.summary = ServingSummary(
        names=names, model_dir=str(model_dir), model_type=facts.model_type, max_model_len=limits.max_model_len,
        max_num_seqs=limits.max_num_seqs, device=engine.ready.device, dtype=engine.ready.dtype,
        tensor_parallel_size=config.parallel.tensor_parallel_size, api_key_required=bool(keys),
    )
    return app
