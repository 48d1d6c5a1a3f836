"""`python -m server`: serve a DeepSeek-V4 checkpoint over an OpenAI-compatible HTTP API.

    python -m server [--model DIR] [--config YAML] [--set key=value ...] [--host H] [--port P]
    python -m server plan --config YAML [--set key=value ...]   # the memory plan only (engine/plan.py)

Without --model (and no model.path in the YAML) it serves the embedded tiny default, building it
first if absent. Logs go to stderr as text or, with `--log-format json`, one JSON object per line
(contract/logs.py). A config that asks for a feature this version does not run is refused
before anything starts (contract/features.py).

SIGTERM or SIGINT drains: /health and /ready turn 503 at once, new completions get 503, in-flight
ones get `server.drain_timeout_s` to finish (streams still running then end with an error frame and
[DONE]), then uvicorn shuts down and the process exits 0. A second signal skips the rest of the drain.
If the engine process dies more often than `server.engine_restarts` allows (server/engine_supervisor.py),
the process exits 1, for a supervisor to restart it.
"""

from __future__ import annotations

import argparse
import os
import sys

from contract.config import FLAG_KEYS, ConfigFileError, load_config
from contract.features import unbuilt_features
from contract.launch_env import launched_externally
from contract.logs import configure_logging

SHUTDOWN_GRACE_S = 5  # after the drain, how long uvicorn waits for connections still open


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (default configs/cpu-tiny.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key")
    parser.add_argument("--api-key", help="bearer key clients must send; visible in the process table: prefer "
                        "DS4SERVE_API_KEY or --api-key-file (one key per line)")
    parser.add_argument("--log-level", default="info")
    for flag in FLAG_KEYS:
        name = "--" + flag.replace("_", "-")
        if flag in ("deterministic", "enforce_eager"):
            parser.add_argument(name, action="store_const", const=True, default=None)
        elif flag == "enable_prefix_caching":
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None)
        elif flag in ("port", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                      "kv_hot_tokens"):
            parser.add_argument(name, type=int)
        elif flag == "gpu_memory_utilization":
            parser.add_argument(name, type=float)
        else:
            parser.add_argument(name)
    return parser.parse_args(argv)


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
    unbuilt = unbuilt_features(config)
    if unbuilt:
        print("cannot start: not built in this version: " + "; ".join(map(str, unbuilt)), file=sys.stderr)
        return 2
    try:
        secrets = config.api_keys(args.api_key)
    except OSError as exc:
        print(f"config error: server.api_key_file: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, config.server.log_format, secrets)
    if launched_externally() and int(os.environ["RANK"]) > 0:  # torchrun's other ranks serve no HTTP
        from engine.factory import serve_external_rank  # this process is a model rank, not a front end

        return serve_external_rank(config)
    import uvicorn

    from server.draining import DrainingServer
    from server.http_edge import OpenAIErrorH11Protocol
    from server.launch import build_server

    try:
        app = build_server(config, api_key=args.api_key)
    except (ConfigFileError, FileNotFoundError, ValueError) as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 2
    server_config = uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S, log_config=None,  # uvicorn logs through our root handler
        http=OpenAIErrorH11Protocol,  # malformed HTTP gets an OpenAI error body too
    )
    DrainingServer(server_config, app.state.lifecycle, app.state.engine_lost).run()
    return 1 if app.state.engine_lost.reason is not None else 0  # non-zero: the engine could not be kept up


if __name__ == "__main__":
    sys.exit(main())
