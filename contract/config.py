"""Server configuration: one YAML file per rig, validated, with `--set` and vLLM-style flag overrides.

Unknown keys are errors that name the key and the file. The result is one frozen object; nothing
rewrites it at run time. Secrets never live in the YAML: the API key comes from `--api-key`, the
DS4SERVE_API_KEY environment variable, or the file named by `server.api_key_file`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_API_KEY = "DS4SERVE_API_KEY"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "cpu-tiny.yaml"
DEFAULT_MODEL_DIR = REPO_ROOT / "default_model"  # the trained tiny V4.1, shipped in the repository


class ConfigFileError(ValueError):
    """A configuration that cannot be used; the message names the file and the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    path: str | None = None  # None: the embedded default (default_model/, the trained tiny V4.1)
    # the name responses report, or several (vLLM's `--served-model-name A B`): the first is reported, every
    # one is accepted in a request's `model` and listed by /v1/models
    served_name: list[str] | None = Field(default=None, min_length=1)
    # prompt + output; None or "auto": the model's position limit (max_position_embeddings; a longer one is
    # refused at start). Unlike vLLM's auto it is not lowered to fit memory: the memory plan refuses what
    # does not fit
    max_model_len: int | None = Field(default=None, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # none: every weight dequantized at load into `dtype` (what this version serves); checkpoint: FP8 / MXFP4
    # weights kept as the checkpoint stores them (the GPU fast path, issue 8: `plan` counts them so, serving
    # refuses it until then)
    quantization: Literal["none", "checkpoint"] = "none"
    # model: activations in `dtype` everywhere (the checkpoint's function, as transformers computes it). fp8
    # (needs quantization: checkpoint): prefill chunks round them to e4m3 per 1 x 128 (a float32 scale each)
    # for the MXFP4 routed experts and the 128-block FP8 linears, which then run on FP8 tensor cores, as
    # DeepSeek's own inference runs the release (~2-3% relative rounding per product); decode steps keep
    # `dtype`. Deterministic mode refuses it (its batch-invariant kernels compute in `dtype`)
    prefill_activations: Literal["model", "fp8"] = "model"
    # auto: the checkpoint's *.safetensors. dummy (vLLM's --load-format dummy): seeded random weights at
    # config.json's dims, drawn on the device (models/dummy_weights.py), so a directory with config.json
    # (and a tokenizer) is enough; held as `quantization` says (checkpoint: the release's MXFP4 experts and
    # FP8 linears, as a released checkpoint is held), with V4.1's Engram tables of the configured size
    # (for disk residency written once as table files into engram.path, default <model.path>/engram)
    load_format: Literal["auto", "dummy"] = "auto"
    seed: int = Field(default=0, ge=0)  # the dummy weights' seed (same seed, same device type: same weights)
    # vLLM's --tokenizer: a directory with tokenizer.json (and tokenizer_config.json, for the chat template);
    # None: model.path's, or with load_format dummy and none there, the embedded default's (default_model/)
    # when its vocabulary is the model's (contract/model_files.py)
    tokenizer: str | None = None

    @field_validator("served_name", mode="before")
    @classmethod
    def _one_name(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fp8_needs_released_weights(self) -> "ModelSection":
        if self.prefill_activations == "fp8" and self.quantization != "checkpoint":
            raise ValueError("prefill_activations: fp8 needs quantization: checkpoint (the FP8 activations feed the "
                             "released FP8 / MXFP4 weights' tensor-core kernels)")
        return self

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _auto_length(cls, value: Any) -> Any:
        return None if value == "auto" else value


class ServerSection(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key_file: str | None = None  # bearer keys, one per line (--api-key and DS4SERVE_API_KEY come first)
    # requests admitted beyond scheduler.max_num_seqs that may wait; past it, 429 with Retry-After
    max_waiting: int = Field(default=1024, gt=0)
    # strings or token lists one completions `prompt` may hold (each is its own engine request, n times);
    # more is a 400 naming prompt, before any is tokenized
    max_prompts_per_request: int = Field(default=1024, gt=0)
    # after SIGTERM, how long in-flight requests may finish before streams are cut off (error frame)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    max_body_bytes: int = Field(default=32 * 2**20, gt=0)  # larger request bodies get 413
    log_format: Literal["text", "json"] = "text"  # json: one object per line, with the request id when known
    # a dead engine process is started again in place up to this many times within
    # engine_restart_window_s; past that the server exits non-zero, for its supervisor to restart it
    engine_restarts: int = Field(default=3, ge=0)
    engine_restart_window_s: float = Field(default=600.0, gt=0)
    # one INFO line per engine request (id, prompt tokens, sampling parameters; never the text), as vLLM's
    # --enable-log-requests
    log_requests: bool = False


class ChatSection(Section):
    """How chat requests become prompts. The chat format and its output parsers are chosen from the model's
    type (server/chat/); the vLLM names below are checked against it at start, so a launch line written
    for another model is refused instead of served wrongly."""

    # a Jinja chat template (a file, or the template itself) that replaces the checkpoint's own; output is
    # still parsed by the model's format
    template: str | None = None
    # chat_template_kwargs every chat request gets; a request's own keys win (e.g. {thinking: false})
    default_template_kwargs: dict[str, Any] = {}
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: deepseek_v4 (V4) or deepseek_v41 (V4.1)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: the above, or deepseek_r1 / deepseek_v3
    tokenizer_mode: str = "auto"  # vLLM's --tokenizer-mode: auto / hf, or the model's deepseek_v4 / deepseek_v41


class SchedulerSection(Section):
    max_num_seqs: int = Field(default=16, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    block_tokens: int = Field(default=128, gt=0)
    enable_prefix_caching: bool = True
    # overlapped scheduling (vLLM's --async-scheduling, SGLang's overlap scheduler): step N+1 is planned
    # while step N runs, its decode inputs taken from step N's draws on the device (docs/overlap.md)
    async_scheduling: bool = True
    # state points the prefix cache keeps (each a copy of one slot's fixed state); None: 4 per sequence
    prefix_snapshots: int | None = Field(default=None, ge=0)

    @property
    def snapshot_slots(self) -> int:
        """Cache slots reserved for prefix-cache snapshots (0 when the cache is off)."""
        if not self.enable_prefix_caching:
            return 0
        return 4 * self.max_num_seqs if self.prefix_snapshots is None else self.prefix_snapshots


class MemorySection(Section):
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    host_memory_gb: float = Field(default=8.0, gt=0)
    num_kv_pages: int | None = Field(default=None, gt=0)  # pin the KV page count (skips the budget)
    # memory of one GPU of the rig (GiB): `python -m server plan` needs it, as it runs without the GPU;
    # serving measures the device it runs on instead
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    # The compressed KV entries and index keys (the paged cache; the sliding window stays in the model
    # dtype). auto: the model dtype. fp4: packed FP4 pages (V4.1: lossless, the model rounds them to FP4
    # itself; 3.5x fewer page bytes than bf16; V4: an opt-in that rounds them, lossy). fp8 (the CLI also
    # takes vLLM's fp8_ds_mla / fp8_e4m3 for it): on V4, float8_e4m3fn with a float32 scale per 64
    # channels, an entry's RoPE channels in bf16 (604 bytes a 512-wide entry; index keys e4m3
    # throughout), lossy as vLLM's fp8; on V4.1 the fp4 packing, logged at startup (its entries are FP4
    # values already: fp4 keeps them exactly and smaller, e4m3 per 64 would round them).
    kv_cache_dtype: Literal["auto", "fp4", "fp8"] = "auto"


class ParallelSection(Section):
    tensor_parallel_size: int = Field(default=1, gt=0)
    timeout_s: float = Field(default=120.0, gt=0)  # a rank silent this long in a collective has failed
    on_rank_failure: Literal["restart", "exit"] = "restart"  # restart the pool, or end the engine (non-zero)


class SpeculativeSection(Section):
    """vLLM's --speculative-config: each decode step verifies `num_speculative_tokens` drafts in one target
    forward (worker/runner.py), greedy or by rejection sampling, so the output is the target's either way.
    Methods: mtp (V4's MTP layer, `mtp.*`, chained for K > 1; vLLM's older name deepseek_mtp is taken too),
    ngram (vLLM's prompt lookup: the tokens after the latest earlier match of the longest suffix of
    prompt_lookup_min..prompt_lookup_max tokens), dspark (the DSpark draft layers of V4.1 or V4-Flash-0731, models/dspark.py: a
    block of drafts from taps of the target, in the checkpoint directory `model` names, as vLLM names a
    separate draft model; the release ships them inside the target's, so that may be the target's own)."""

    method: Literal["mtp", "ngram", "dspark"]
    num_speculative_tokens: int = Field(gt=0, le=15)
    prompt_lookup_min: int | None = Field(default=None, gt=0)  # ngram only; default 1
    prompt_lookup_max: int | None = Field(default=None, gt=0)  # ngram only; default max(4, prompt_lookup_min)
    model: str | None = None  # dspark only (and required): the draft checkpoint's directory
    # dspark only: DeepSpec's --confidence-threshold, the drafts cut before the first whose confidence
    # head's score (a sigmoid) is below it; 0 (the default) keeps them all
    confidence_threshold: float | None = Field(default=None, ge=0, le=1)
    # ds4serve's: each step verifies the number of drafts (0 .. num_speculative_tokens) with the most
    # expected tokens per second, from measured acceptance and step cost (scheduler/spec_policy.py);
    # false: always num_speculative_tokens, as vLLM
    adaptive: bool = True

    @field_validator("method", mode="before")
    @classmethod
    def _vllm_names(cls, value: Any) -> Any:
        return "mtp" if value == "deepseek_mtp" else value

    @model_validator(mode="after")
    def _lookup_sizes(self) -> "SpeculativeSection":
        sizes = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "ngram" and sizes != (None, None):
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max are for method ngram, not {self.method}")
        if self.method == "ngram" and self.lookup_sizes[0] > self.lookup_sizes[1]:
            raise ValueError(f"prompt_lookup_min {self.lookup_sizes[0]} is above prompt_lookup_max {self.lookup_sizes[1]}")
        return self

    @model_validator(mode="after")
    def _draft_model(self) -> "SpeculativeSection":
        if self.method == "dspark" and not self.model:
            raise ValueError("method dspark needs model: the directory of its draft checkpoint (config.json with"
                             " the dspark_* keys and the mtp.* tensors; the target's own directory when they ship in it)")
        if self.method != "dspark" and (self.model is not None or self.confidence_threshold is not None):
            raise ValueError(f"model / confidence_threshold are for method dspark, not {self.method}")
        return self

    @property
    def lookup_sizes(self) -> tuple[int, int]:
        """ngram's (min, max) suffix lengths, defaults filled in."""
        low = self.prompt_lookup_min or 1
        return low, self.prompt_lookup_max or max(4, low)


class RuntimeSection(Section):
    deterministic: bool = False
    # decode steps replay CUDA graphs on the GPU (worker/cuda_graphs.py); true: every step eager, as vLLM's flag
    enforce_eager: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # vLLM's --speculative-config (e.g. {method: mtp, num_speculative_tokens: 2}); {} or null: none
    speculative_config: SpeculativeSection | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == {} else value

    @property
    def draft_tokens(self) -> int:
        """The most drafts a step verifies (0: no speculative decoding)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    @property
    def drafts_with_mtp(self) -> bool:
        """Whether the checkpoint's MTP layer drafts (so it is loaded, and planned)."""
        return self.speculative_config is not None and self.speculative_config.method == "mtp"


# the names of engram_store/build.py's RESIDENCIES registry (contract/ cannot import it: a test keeps them equal)
EngramResidency = Literal["gpu", "host", "disk"]


class EngramLayerSection(Section):
    residency: EngramResidency


class EngramSection(Section):
    residency: EngramResidency = "host"  # every Engram layer, unless `layers` says otherwise
    # table files for disk residency (default: <model>/engram, converted on first use; drawn for dummy weights)
    path: str | None = None
    host_cache_gb: float = Field(default=4.0, ge=0)  # host row cache in front of disk tables
    gpu_cache_gb: float = Field(default=0.0, ge=0)  # device row cache in front of the host one
    queue_depth: int = Field(default=64, gt=0)  # io_uring reads in flight
    resident_scales: bool = False  # keep only the scales in RAM (tables converted with separate scales)
    layers: dict[int, EngramLayerSection] = {}  # per-layer overrides, keyed by layer id


class MetricsSection(Section):
    vllm_compat: bool = True


class OffloadSection(Section):
    """What leaves the GPU for rigs whose GPUs cannot hold the model. Expert offload (issue 28): `plan`
    places `experts: host` (engine/expert_placement.py); serving it and `disk` are not built yet
    (contract/features.py)."""

    experts: Literal["none", "host", "disk"] = "none"  # routed experts in host RAM / on NVMe, streamed per step
    # with experts host: the routed experts of each MoE layer kept on the GPU (the rest in pinned host
    # RAM), as a count per layer or as a GPU budget per rank for all layers (at most one of the two);
    # neither: as many as the GPU holds after the rest of the plan and every sequence's full-length KV
    gpu_experts_per_layer: int | None = Field(default=None, ge=0)
    gpu_experts_gb: float | None = Field(default=None, ge=0)
    staging_experts: int = Field(default=16, gt=0)  # GPU slots that host-resident experts are staged in
    # host_packed: V4.1's compressed KV entries packed FP4 (as memory.kv_cache_dtype fp4) in pinned shared
    # host memory, budgeted by memory.host_memory_gb; the GPU keeps the index keys and each running
    # sequence's last kv_hot_tokens tokens of entries (models/host_tier.py). Reads are bitwise the same.
    kv: Literal["none", "host_packed"] = "none"
    kv_hot_tokens: int = Field(default=32768, gt=0)

    @model_validator(mode="after")
    def _one_expert_budget(self) -> "OffloadSection":
        budgets = {"gpu_experts_per_layer": self.gpu_experts_per_layer, "gpu_experts_gb": self.gpu_experts_gb}
        given = [key for key, value in budgets.items() if value is not None]
        if len(given) > 1:
            raise ValueError("give offload.gpu_experts_per_layer or offload.gpu_experts_gb, not both")
        if given and self.experts != "host":
            raise ValueError(f"offload.{given[0]} places experts for offload.experts: host, which is {self.experts!r}")
        return self


class PrefixCacheSection(Section):
    """The prefix cache's tiers below the GPU (docs/prefix-tiers.md): evicted state points spill to pinned
    host RAM, and through it (write-through) to files on NVMe that survive a restart. Each budget is its
    own, beside memory.host_memory_gb; `python -m server plan` shows what they hold."""

    host_gb: float = Field(default=0.0, ge=0)  # pinned host RAM of the host tier, all ranks together (0: off)
    disk_gb: float = Field(default=0.0, ge=0)  # NVMe of the disk tier, all ranks together (0: off); needs host_gb
    dir: str | None = None  # the disk tier's files and catalog (required with disk_gb > 0; created if missing)


class ServeConfig(Section):
    model: ModelSection = ModelSection()
    server: ServerSection = ServerSection()
    chat: ChatSection = ChatSection()
    scheduler: SchedulerSection = SchedulerSection()
    memory: MemorySection = MemorySection()
    parallel: ParallelSection = ParallelSection()
    runtime: RuntimeSection = RuntimeSection()
    engram: EngramSection = EngramSection()
    metrics: MetricsSection = MetricsSection()
    offload: OffloadSection = OffloadSection()
    prefix_cache: PrefixCacheSection = PrefixCacheSection()

    @model_validator(mode="after")
    def _fp8_prefill_is_not_deterministic(self) -> "ServeConfig":
        if self.model.prefill_activations == "fp8" and self.runtime.deterministic:
            raise ValueError("model.prefill_activations: fp8 and runtime.deterministic: the batch-invariant kernels "
                             "compute in the model dtype; choose one")
        return self

    @property
    def model_dir(self) -> Path:
        return Path(self.model.path) if self.model.path else DEFAULT_MODEL_DIR

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the model is served under, the reported one first."""
        return tuple(self.model.served_name or (self.model_dir.name,))

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    def api_keys(self, flag_key: str | None = None) -> tuple[str, ...]:
        if flag_key:
            return (flag_key,)
        if os.environ.get(ENV_API_KEY):
            return (os.environ[ENV_API_KEY],)
        if self.server.api_key_file:
            lines = Path(self.server.api_key_file).read_text().split()
            return tuple(line for line in lines if line)
        return ()


# vLLM-style flags and the YAML key each one sets.
FLAG_KEYS = {
    "model": "model.path",
    "served_model_name": "model.served_name",
    "max_model_len": "model.max_model_len",
    "dtype": "model.dtype",
    "load_format": "model.load_format",
    "tokenizer": "model.tokenizer",
    "host": "server.host",
    "port": "server.port",
    "log_format": "server.log_format",
    "api_key_file": "server.api_key_file",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "block_size": "scheduler.block_tokens",
    "enable_prefix_caching": "scheduler.enable_prefix_caching",
    "async_scheduling": "scheduler.async_scheduling",
    "gpu_memory_utilization": "memory.gpu_memory_utilization",
    "kv_cache_dtype": "memory.kv_cache_dtype",
    "kv_offload": "offload.kv",
    "kv_hot_tokens": "offload.kv_hot_tokens",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "deterministic": "runtime.deterministic",
    "enforce_eager": "runtime.enforce_eager",
    "device": "runtime.device",
    "speculative_config": "runtime.speculative_config",
    "enable_log_requests": "server.log_requests",  # --disable-log-requests sets it false
    "chat_template": "chat.template",
    "default_chat_template_kwargs": "chat.default_template_kwargs",
    "tool_call_parser": "chat.tool_call_parser",
    "reasoning_parser": "chat.reasoning_parser",
    "tokenizer_mode": "chat.tokenizer_mode",
}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigFileError(f"{origin}: {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, flags: dict[str, Any] | None = None
) -> ServeConfig:
    """YAML (default configs/cpu-tiny.yaml), then `--set key=value` overrides, then flags."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read config: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of sections")
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigFileError(f"--set {item!r}: expected key=value, e.g. scheduler.max_num_seqs=8")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw), "--set")
    set_by_flag = {}
    for flag, value in (flags or {}).items():
        if value is not None:
            set_by_flag[FLAG_KEYS[flag]] = f"--{flag.replace('_', '-')}"
            _set_dotted(tree, FLAG_KEYS[flag], value, set_by_flag[FLAG_KEYS[flag]])
    try:
        config = ServeConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigFileError(f"{path}: {_problems(exc, set_by_flag)}") from None
    problems = _prefix_cache_problems(config, set_by_flag)
    if problems:
        raise ConfigFileError(f"{path}: {'; '.join(problems)}")
    return config


def _prefix_cache_problems(config: ServeConfig, set_by_flag: dict[str, str]) -> list[str]:
    """prefix_cache settings that cannot work with the rest of the config (each section alone is valid)."""
    tiers, problems = config.prefix_cache, []
    if tiers.disk_gb > 0:
        if not tiers.dir:
            problems.append("prefix_cache.dir: required with prefix_cache.disk_gb > 0 (where the disk tier's files go)")
        if tiers.host_gb == 0:
            problems.append("prefix_cache.disk_gb: the disk tier is written through the host tier; set"
                            " prefix_cache.host_gb > 0 too")
    if (tiers.host_gb > 0 or tiers.disk_gb > 0) and not config.scheduler.enable_prefix_caching:
        key = "prefix_cache.host_gb" if tiers.host_gb > 0 else "prefix_cache.disk_gb"
        problems.append(f"{key}: the tiers keep the prefix cache's state points, and"
                        f" {_flagged('scheduler.enable_prefix_caching', set_by_flag)} is false")
    return problems


def _flagged(key: str, set_by_flag: dict[str, str]) -> str:
    """The key, with the flag that set it if one did."""
    return f"{key} ({set_by_flag[key]})" if key in set_by_flag else key


def _problems(exc: ValidationError, set_by_flag: dict[str, str]) -> str:
    """Each problem with its key, and the flag that set the key if one did (the YAML did not say it)."""
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        flag = next((set_by_flag[k] for k in set_by_flag if key == k or key.startswith(k + ".")), None)
        where = f"{key} ({flag})" if flag else key
        problems.append(f"{where}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}")
    return "; ".join(problems)
