"""The command line of `python -m server`: vLLM's launch lines, as `vllm serve` reads them.

    python -m server [serve] [MODEL] [--config YAML] [--set key=value ...] [vLLM-style flags]
    python -m server plan --config YAML [--set key=value ...]   # the memory plan only (engine/plan.py)

Flags that set a config key (contract/config.py FLAG_KEYS) win over --set, which wins over the YAML.
As vLLM does, `--max_model_len` is `--max-model-len`, and a JSON flag takes its keys one by one too
(`--default-chat-template-kwargs.thinking false`). The other vLLM flags a DeepSeek-V4 launch line uses
(vLLM's recipes) are accepted when this server does what they ask anyway, refused before anything starts
when they ask for what is not built (`not_built`), and, when they only tune vLLM's own kernels or
compiler, accepted and named in one warning at start (`no_effect`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

import yaml

from contract.config import DEFAULT_CONFIG, FLAG_KEYS, ServeConfig, load_config
from server.chat_options import REASONING_PARSERS, TOKENIZER_MODES, TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}
KV_CACHE_DTYPES = {"auto": "auto", "fp4": "fp4", "fp8": "fp8", "fp8_ds_mla": "fp8", "fp8_e4m3": "fp8"}
LOAD_FORMATS = {"auto": "auto", "safetensors": "auto", "dummy": "dummy"}  # vLLM's names for what this server loads
SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
# vLLM tuning of its own kernels and compiler: no counterpart here
NO_EFFECT = ("compilation_config", "attention_config", "kernel_config", "moe_backend", "max_cudagraph_capture_size",
             "enable_flashinfer_autotune")


class JsonObject(argparse.Action):
    """A JSON object flag (null: none). Given again, or key by key as `--flag.key value`, the objects merge."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            value = json.loads(values)
        except json.JSONDecodeError as exc:
            parser.error(f"argument {option_string}: not valid JSON ({exc}): {values!r}")
        if value is None:
            value = {}
        if not isinstance(value, dict):
            parser.error(f"argument {option_string}: must be a JSON object, got {values!r}")
        setattr(namespace, self.dest, _merged(getattr(namespace, self.dest) or {}, value))


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def context_length(text: str) -> int | str:
    """vLLM's --max-model-len forms: N, "auto" (the model's limit), or N with a suffix: lowercase
    decimal (128k = 128000), uppercase binary (128K = 131072)."""
    if text == "auto":
        return text
    number, scale = (text[:-1], SUFFIXES[text[-1]]) if text[-1:] in SUFFIXES else (text, 1)
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of tokens (e.g. 32768, 32k, 32K) or auto")
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: not a whole number of tokens")
    return int(value)


def kv_cache_dtype_name(text: str) -> str:
    """vLLM's fp8 spellings are one value here (memory.kv_cache_dtype fp8)."""
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[text]


def load_format_name(text: str) -> str:
    """vLLM's `safetensors` is what auto loads here; its other formats (pt, gguf, ...) are not read."""
    if text not in LOAD_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(LOAD_FORMATS)}")
    return LOAD_FORMATS[text]


def dtype_name(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(DTYPES)}")
    return DTYPES[text]


def _default(config: ServeConfig, flag: str) -> Any:
    node: Any = config
    for part in FLAG_KEYS[flag].split("."):
        node = getattr(node, part)
    return node


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "on", False: "off"}[value]
    if isinstance(value, list):
        return " ".join(value)
    return json.dumps(value) if isinstance(value, dict) else str(value)


def build_parser() -> argparse.ArgumentParser:
    from server.app import VERSION  # the HTTP app's version, which /version reports too

    defaults = load_config()  # what runs without --config

    def config_help(flag: str, text: str) -> str:
        """`text`, then the key the flag sets and its value without --config."""
        return f"{text} [{FLAG_KEYS[flag]}; default: {_shown(_default(defaults, flag)).replace('%', '%%')}]"

    parser = argparse.ArgumentParser(
        prog="python -m server", usage="python -m server [serve] [MODEL] [options]  |  python -m server plan [options]",
        description="Serve a DeepSeek-V4 / V4.1 checkpoint over an OpenAI-compatible HTTP API, from vLLM's launch lines.",
        epilog=f"Subcommands: serve (the default: `python -m server serve MODEL` = `python -m server MODEL`); plan "
               f"(`python -m server plan --config YAML`: the memory plan of a rig, nothing served; see its --help). "
               f"Defaults in [] are {DEFAULT_CONFIG.name}'s, what runs without --config; a --config file's values "
               f"replace them, --set wins over the file and a flag over both.",
    )
    add = parser.add_argument
    add("--version", action="version", version=f"ds4serve {VERSION}")
    add("model_tag", nargs="?", metavar="MODEL", help="the checkpoint directory, as `vllm serve MODEL` takes it (= --model)")

    group = parser.add_argument_group("config").add_argument
    group("--config", metavar="YAML", help=f"the rig's config file (default: configs/{DEFAULT_CONFIG.name})")
    group("--set", action="append", default=[], metavar="KEY=VALUE",
          help="override any config key, e.g. --set scheduler.max_num_seqs=8 (repeatable)")

    group = parser.add_argument_group("model").add_argument
    group("--model", metavar="DIR", help=config_help("model", "checkpoint directory (none: the embedded default, "
                                                     "default_model/)"))
    group("--served-model-name", nargs="+", metavar="NAME", help=config_help(
        "served_model_name", "the names clients send as `model`: the first is the one responses report; every one "
        "is accepted and listed by /v1/models (default without a name: the directory's name)"))
    group("--max-model-len", type=context_length, metavar="N|auto", help=config_help(
        "max_model_len", "prompt + output tokens per sequence: N, 32k (= 32000), 32K (= 32768) or auto (the model's "
        "max_position_embeddings, also when unset; past it the server refuses to start)"))
    group("--dtype", type=dtype_name, metavar="{" + ",".join(DTYPES) + "}",
          help=config_help("dtype", "weight dtype; auto: bfloat16 on a GPU, float32 on the CPU"))
    group("--load-format", type=load_format_name, metavar="{" + ",".join(LOAD_FORMATS) + "}", help=config_help(
        "load_format", "auto (= safetensors): the checkpoint's weights; dummy: seeded random weights (model.seed) at "
        "config.json's dims, drawn on the device, in the format model.quantization names: a directory with "
        "config.json and a tokenizer is enough"))
    group("--tokenizer", metavar="DIR", help=config_help(
        "tokenizer", "the directory of tokenizer.json (and tokenizer_config.json) (none: the model's; with "
        "--load-format dummy and none there, the embedded default's when its vocabulary is the model's)"))
    group("--tokenizer-mode", choices=TOKENIZER_MODES, help=config_help(
        "tokenizer_mode", "vLLM's tokenizer mode: the checkpoint's tokenizer.json with the model's own "
        "chat encoder is always used; a DeepSeek name must be the model's (deepseek_v4 for V4, deepseek_v41 for V4.1)"))
    group("--trust-remote-code", action="store_true",
          help="accepted for vLLM launch lines; this server never runs code from a checkpoint (V4 / V4.1 are built in)")
    group("--device", choices=("auto", "cpu", "cuda"), help=config_help("device", "where the model runs"))

    group = parser.add_argument_group("chat").add_argument
    group("--chat-template", metavar="FILE_OR_TEMPLATE", help=config_help(
        "chat_template", "a Jinja chat template (a file, or the template text) rendering prompts instead of the "
        "checkpoint's own; output is still parsed by the model's format"))
    group("--default-chat-template-kwargs", action=JsonObject, metavar="JSON", help=config_help(
        "default_chat_template_kwargs", "chat_template_kwargs every chat request gets under its own (its keys win), "
        "e.g. '{\"thinking\": false}' to turn thinking off for clients that cannot send it"))
    group("--enable-auto-tool-choice", action="store_true",
          help="accepted: tool calls are always parsed into tool_calls (tool_choice auto or none)")
    group("--tool-call-parser", choices=tuple(TOOL_PARSERS), help=config_help(
        "tool_call_parser", "vLLM's tool parser: the model's own format is always parsed; a name of "
        "another format is refused at start"))
    group("--reasoning-parser", choices=REASONING_PARSERS, help=config_help(
        "reasoning_parser", "vLLM's reasoning parser: <think>...</think> is always split off into "
        "reasoning_content; deepseek_v4 / deepseek_v41 must be the model's"))

    group = parser.add_argument_group("server").add_argument
    group("--host", help=config_help("host", "address to listen on"))
    group("--port", type=int, metavar="N", help=config_help("port", "port to listen on"))
    group("--api-key", metavar="KEY", help="bearer key clients must send; visible in the process table: prefer "
          "DS4SERVE_API_KEY or --api-key-file (default: none, the API is open)")
    group("--api-key-file", metavar="FILE", help=config_help("api_key_file", "bearer keys, one per line"))
    group("--log-level", default="info", choices=LOG_LEVELS, type=str.lower,
          help="this server's log level (default: %(default)s)")
    group("--log-format", choices=("text", "json"), help=config_help(
        "log_format", "json: one log object per line, and no progress bars"))
    group("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, type=str.lower,
          help="uvicorn's log level, for its access and error lines (default: --log-level)")
    group("--disable-uvicorn-access-log", action="store_true", help="no access line per HTTP request")
    group("--enable-log-requests", action="store_const", const=True, help=config_help(
        "enable_log_requests", "one INFO line per engine request: id, prompt tokens and sampling parameters "
        "(never the text)"))
    group("--disable-log-requests", dest="enable_log_requests", action="store_const", const=False,
          help="no line per request (vLLM's older flag; what happens unless --enable-log-requests)")

    group = parser.add_argument_group("scheduler and memory").add_argument
    group("--max-num-seqs", type=int, metavar="N", help=config_help("max_num_seqs", "sequences run at once"))
    group("--max-num-batched-tokens", type=int, metavar="N", help=config_help("max_num_batched_tokens", "tokens one step runs"))
    group("--block-size", type=int, metavar="N", help=config_help("block_size", "tokens per KV page"))
    group("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
          help=config_help("enable_prefix_caching", "reuse the KV of prompts' shared prefixes"))
    group("--async-scheduling", action=argparse.BooleanOptionalAction,
          help=config_help("async_scheduling", "plan the next step while this one runs (overlapped scheduling)"))
    group("--disable-overlap-schedule", dest="async_scheduling", action="store_false", default=None,
          help="SGLang's spelling of --no-async-scheduling")
    group("--enable-chunked-prefill", action="store_true",
          help="accepted: prompts are always prefilled in chunks of --max-num-batched-tokens")
    group("--gpu-memory-utilization", type=float, metavar="FRACTION", help=config_help(
        "gpu_memory_utilization", "share of the GPU's memory the server may use"))
    group("--kv-cache-dtype", type=kv_cache_dtype_name, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}", help=config_help(
        "kv_cache_dtype", "compressed KV entries and index keys; fp4: packed FP4 (V4.1: lossless; V4: rounded, "
        "lossy); fp8 (= vLLM's fp8_ds_mla, fp8_e4m3): on V4 e4m3 with a scale per 64 channels and the RoPE "
        "channels in bf16 (lossy), on V4.1 the fp4 packing (its entries are FP4 already: lossless and smaller)"))
    group("--kv-offload", choices=("none", "host_packed"), help=config_help(
        "kv_offload", "host_packed: V4.1's compressed KV in pinned host RAM"))
    group("--kv-hot-tokens", type=int, metavar="N", help=config_help(
        "kv_hot_tokens", "with --kv-offload host_packed, each sequence's last tokens kept on the GPU"))
    group("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction,
          help="accepted off (--no-...): this model's cache is always the hybrid sliding + compressed one")

    group = parser.add_argument_group("parallelism and runtime").add_argument
    group("--tensor-parallel-size", "-tp", type=int, metavar="N", help=config_help(
        "tensor_parallel_size", "ranks the model is split over (routed experts go whole to a rank)"))
    group("--enable-expert-parallel", action="store_true",
          help="accepted: routed experts are always split whole among the tensor-parallel ranks")
    group("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N", help="only 1 is built (default: %(default)s)")
    group("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
          help="only 1 is built: run one server per replica (default: %(default)s)")
    group("--distributed-executor-backend", choices=("mp", "uni", "external_launcher"),
          help="accepted: ranks are spawned processes, or torchrun's (ray is not built)")
    group("--deterministic", action="store_const", const=True, help=config_help(
        "deterministic", "batch-invariant results: a request's tokens do not depend on what runs beside it"))
    group("--enforce-eager", action="store_const", const=True, help=config_help(
        "enforce_eager", "no CUDA graphs: every decode step runs eagerly"))
    group("--speculative-config", action=JsonObject, metavar="JSON", help=config_help(
        "speculative_config", "vLLM's speculative decoding, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'"
        " (methods mtp, ngram with prompt_lookup_min / prompt_lookup_max, dspark with model: its draft checkpoint's"
        " directory, and confidence_threshold)"))
    group("--language-model-only", action="store_true", help="accepted: only the language model is loaded")
    group("--mm-encoder-tp-mode", metavar="MODE", help="not built: no vision encoder is loaded")
    group("--kv-transfer-config", action=JsonObject, metavar="JSON",
          help="not built: disaggregated prefill / decode; refused unless {} or null")
    group("--enable-sleep-mode", action="store_true", help="not built: refused")

    group = parser.add_argument_group(
        "vLLM kernel and compiler tuning", "accepted so that vLLM launch lines start; they tune vLLM's own kernels "
        "and have no counterpart here: each one given is named in a warning at start").add_argument
    group("--compilation-config", action=JsonObject, metavar="JSON", help="torch.compile / CUDA graph modes")
    group("--attention-config", action=JsonObject, metavar="JSON", help="e.g. use_fp4_indexer_cache")
    group("--kernel-config", action=JsonObject, metavar="JSON", help="kernel backends and warm-ups")
    group("--moe-backend", metavar="NAME", help="the fused MoE kernel")
    group("--max-cudagraph-capture-size", type=int, metavar="N", help="the largest CUDA graph batch")
    group("--enable-flashinfer-autotune", action=argparse.BooleanOptionalAction, help="FlashInfer's autotuning")
    return parser


def normalize(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's spellings: `--max_model_len` for `--max-model-len`, and `--json-flag.key[.key] value` (or
    `=value`; the value read as YAML: true, 2, text) for `--json-flag '{"key": value}'`."""
    json_flags = {s for a in parser._actions if isinstance(a, JsonObject) for s in a.option_strings}
    out, items = [], list(argv)
    while items:
        item = items.pop(0)
        if not item.startswith("--") or item == "--":
            out.append(item)
            continue
        name, eq, value = item.partition("=")
        flag, dot, path = name.partition(".")
        flag = flag.replace("_", "-")
        if not dot or flag not in json_flags:
            out.append(flag + (dot + path) + eq + value)
            continue
        if not eq:
            if not items:
                parser.error(f"argument {name}: expected a value")
            value = items.pop(0)
        nested: Any = yaml.safe_load(value)
        for key in reversed(path.split(".")):
            nested = {key: nested}
        out += [flag, json.dumps(nested)]
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`serve` first is vLLM's subcommand (the only one besides plan, which __main__ runs before this)."""
    argv = list(argv[1:] if argv[:1] == ["serve"] else argv)
    parser = build_parser()
    args = parser.parse_args(normalize(argv, parser))
    if args.model_tag is not None:
        if args.model not in (None, args.model_tag):
            parser.error(f"the model is given twice: MODEL {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return args


def not_built(args: argparse.Namespace) -> list[str]:
    """The flags given that ask for what this version does not run (refused before anything starts)."""
    found = []
    if args.pipeline_parallel_size != 1:
        found.append(f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline parallelism is not built; "
                     "use --tensor-parallel-size")
    if args.data_parallel_size != 1:
        found.append(f"--data-parallel-size {args.data_parallel_size}: data parallelism is not built; run one server "
                     "per replica")
    if args.disable_hybrid_kv_cache_manager:
        found.append("--disable-hybrid-kv-cache-manager: this model's cache is always the hybrid one")
    if args.mm_encoder_tp_mode is not None:
        found.append(f"--mm-encoder-tp-mode {args.mm_encoder_tp_mode}: images are not served (no vision encoder)")
    if args.kv_transfer_config:
        found.append("--kv-transfer-config: disaggregated prefill / decode is not built")
    if args.enable_sleep_mode:
        found.append("--enable-sleep-mode: sleep mode is not built")
    return found


def no_effect(args: argparse.Namespace) -> list[str]:
    """The vLLM kernel / compiler flags given, which change nothing here (named in a warning)."""
    return ["--" + dest.replace("_", "-") for dest in NO_EFFECT if getattr(args, dest) not in (None, False, {})]
