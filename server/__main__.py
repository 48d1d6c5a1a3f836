"""`python -m server`: serve a DeepSeek-V4 checkpoint over an OpenAI-compatible HTTP API.

    python -m server [serve] [MODEL] [--config YAML] [--set key=value ...] [vLLM-style flags]
    python -m server plan --config YAML [--set key=value ...]   # the memory plan only (engine/plan.py)

The command line is vLLM's (server/cli.py; `--help` lists every flag). Without a model (no MODEL,
--model or model.path in the YAML) it serves the embedded default, default_model/ (the trained tiny V4.1).
Logs go to stderr as text or, with `--log-format json`, one JSON object per line (contract/logs.py).
A config or flag that asks for a feature this version does not run is refused before anything starts
(contract/features.py, server/cli.py), exit code 2 as for any config error. Once the server listens
it logs a summary: its URL, the model, the limits, whether a key is required, the endpoints.

SIGTERM or SIGINT drains: /health and /ready turn 503 at once, new completions get 503, in-flight
ones get `server.drain_timeout_s` to finish (streams still running then end with an error frame and
[DONE]), then uvicorn shuts down and the process exits 0. A second signal skips the rest of the drain.
If the engine process dies more often than `server.engine_restarts` allows (server/engine_supervisor.py),
the process exits 1, for a supervisor to restart it.
"""

from __future__ import annotations

import logging
import os
import sys

from contract.config import FLAG_KEYS, ConfigFileError, load_config
from contract.features import unbuilt_features
from contract.launch_env import launched_externally
from contract.logs import configure_logging
from server.cli import no_effect, not_built, parse_args

SHUTDOWN_GRACE_S = 5  # after the drain, how long uvicorn waits for connections still open
# How long an idle keep-alive connection stays open. uvicorn's 5 s equals httpx's (and so the openai
# client's) keep-alive expiry: a client reusing a connection just as the server closes it gets a
# "connection reset" on a POST it cannot retry. Longer than the common clients' expiries (httpx 5 s,
# aiohttp 15 s), the client always lets go first.
KEEP_ALIVE_S = 65
log = logging.getLogger("ds4serve.launch")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # not the HTTP front end: the engine's arithmetic, in this CLI process
        from engine.plan import main as plan

        return plan(argv[1:])
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.set, {flag: getattr(args, flag) for flag in FLAG_KEYS})
    except ConfigFileError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    unbuilt = [str(feature) for feature in unbuilt_features(config)] + not_built(args)
    if unbuilt:
        print("cannot start: not built in this version: " + "; ".join(unbuilt), file=sys.stderr)
        return 2
    try:
        secrets = config.api_keys(args.api_key)
    except OSError as exc:
        print(f"config error: server.api_key_file: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, config.server.log_format, secrets)
    if no_effect(args):
        log.warning("accepted, but vLLM kernel / compiler settings have no counterpart here: %s",
                    ", ".join(no_effect(args)))
    if launched_externally() and int(os.environ["RANK"]) > 0:  # torchrun's other ranks serve no HTTP
        from engine.factory import serve_external_rank  # this process is a model rank, not a front end

        return serve_external_rank(config)
    import uvicorn

    from server.announced_server import AnnouncedServer
    from server.http_edge import OpenAIErrorH11Protocol
    from server.launch import build_server

    try:
        app = build_server(config, api_key=args.api_key)
    except (ConfigFileError, FileNotFoundError, ValueError) as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 2
    server_config = uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=args.uvicorn_log_level or args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S, log_config=None,  # uvicorn logs through our root handler
        http=OpenAIErrorH11Protocol,  # malformed HTTP gets an OpenAI error body too
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    AnnouncedServer(server_config, app.state.lifecycle, app.state.engine_lost).run()
    return 1 if app.state.engine_lost.reason is not None else 0  # non-zero: the engine could not be kept up


if __name__ == "__main__":
    sys.exit(main())
