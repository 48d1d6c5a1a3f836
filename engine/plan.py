"""`python -m server plan --config X`: a rig's memory plan, every byte by purpose, without serving.

Runs on any machine (no GPU, no weights): the model comes from config.json on the meta device
(engine/plan_weights.py), the rig from the YAML (`memory.gpu_memory_gb` stands in for the device the
server would measure). The KV arithmetic is engine/admission.py's, the one the engine uses at start:

    KV pages = (budget - weights - workspace - slot state) / page bytes,  per rank

Measured vs estimated: weights, page and slot bytes are exact (the same tensors the engine allocates,
on the meta device); the workspace is an estimate (logits buffers exactly, activations per token of
the largest step), which the server replaces with the peak of a profiled step when it starts.
With --speculative-config the draft counts too: the MTP layer's weights and cache, or a DSpark draft's
weights (as load_dspark holds them) and its stages' context rings, from the draft directory's config.json
(else the published one under configs/models/<its name>/: the release's draft is the target's checkpoint).
Engram tables are planned in their tiers (gpu: split across ranks; host: whole tables in RAM; disk:
files on NVMe with host and device row caches), at the release's row format: fp8 values and one ue8m0
scale per 32 channels.

Exit status: 0 the rig fits; 1 it does not (the message says by how much and what to change, or which
unbuilt feature it names, contract/features.py); 2 the config itself is wrong (names the key and file).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from contract.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    ConfigFileError,
    OffloadSection,
    ServeConfig,
    load_config,
)
from contract.features import Unbuilt, unbuilt_features
from contract.limits import PrefixTierLimits
from engine.admission import MemoryPlan, MemoryPlanError, plan_pages
from engine.layout import (
    EngineConfigError,
    check_kv_cache_dtype,
    check_dspark,
    check_mtp,
    draft_state_bytes,
    max_model_len,
    meta_cache,
    prefix_records,
    prefix_tiers,
    resolve_dtype,
)
from engine.memory_plan import RecordLayout
from engine.expert_placement import ROUTED, ExpertPlacement, place_experts, routed_expert_shape
from engine.plan_weights import KINDS, WeightTensor, draft_tensors, weight_tensors
from engram_store.build import RESIDENCIES
from models.cache import page_granularity
from models.config import ConfigError, ModelConfig
from models.dspark import DSparkConfig
from models.loader import CheckpointError

GiB = 2**30
DRAFT_KINDS = ("DSpark draft layers", "MTP draft layer")
MODELS_DIR = REPO_ROOT / "configs" / "models"
FP32 = 4  # logits and activations are float32


class PlanRefused(Exception):
    """The rig cannot run this config; the message says what is missing."""


@dataclass(frozen=True)
class EngramPlan:
    """Where each Engram table lives and what it costs in each tier."""

    layers: tuple[tuple[int, int, str], ...]  # (layer id, rows, residency)
    row_bytes: int  # values + scales of one row
    device_bytes: int  # per rank: gpu-resident tables (split across ranks) and the device row cache
    host_bytes: int  # host-resident tables, the host row cache, resident scales
    disk_bytes: int  # table files of the layers whose residency reads files (excluding page padding)


@dataclass(frozen=True)
class RigPlan:
    config_path: Path
    model_json: Path
    model_config: ModelConfig
    device: str
    ranks: int
    dtype: torch.dtype
    quantization: str
    weights: tuple[WeightTensor, ...]
    engram: EngramPlan | None
    activations_bytes: int  # estimate
    logits_bytes: int  # the runner's logits buffer (and the prefix cache's last logits)
    max_model_len: int
    max_num_seqs: int
    kv: MemoryPlan
    host_budget_bytes: int
    needs: tuple[str, ...]  # unbuilt features the plan assumes
    records: RecordLayout  # the prefix cache tiers' records, per rank
    prefix_tiers: PrefixTierLimits  # per rank
    experts: ExpertPlacement | None = None  # offload.experts host: which routed experts stay on the GPU
    draft_state_bytes: int = 0  # per rank: the draft proposer's own state (part of kv.slot_state_bytes)
    dspark: DSparkConfig | None = None  # the DSpark draft that drafts (--speculative-config method dspark)

    @property
    def weights_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights)

    @property
    def weights_per_rank(self) -> int:
        return sum(t.per_rank(self.ranks) for t in self.weights)

    @property
    def gpu_weights_per_rank(self) -> int:
        """What a rank's compute device holds of the weights: all of them, or with expert offload the
        routed experts it keeps resident and its staging ring instead of every routed expert."""
        if self.experts is None:
            return self.weights_per_rank
        routed = sum(t.per_rank(self.ranks) for t in self.weights if t.kind == ROUTED)
        return self.weights_per_rank - routed + self.experts.gpu_bytes + self.experts.staging_bytes


def model_config_json(config: ServeConfig, override: str | None = None) -> Path:
    """The config.json the plan reads: --model-config, else the checkpoint's, else the published one
    shipped under configs/models/<checkpoint directory name>/ (the checkpoint is on the rig, not here)."""
    if override:
        return Path(override)
    for candidate in (config.model_dir / "config.json", MODELS_DIR / config.model_dir.name / "config.json"):
        if candidate.exists():
            return candidate
    shipped = MODELS_DIR / config.model_dir.name
    raise ConfigFileError(f"model.path: no config.json in {config.model_dir} nor in {shipped}")


def draft_config_json(model: str) -> Path:
    """A DSpark draft directory's config.json: its own, else the published one shipped under
    configs/models/<its directory name>/ (the release's draft is the target's checkpoint, on the rig)."""
    own = Path(model) / "config.json"
    shipped = MODELS_DIR / Path(model).name / "config.json"
    return shipped if not own.exists() and shipped.exists() else own


def dspark_draft(config: ServeConfig, model_config: ModelConfig) -> tuple[DSparkConfig, Path] | None:
    """The DSpark draft --speculative-config names (its config and config.json), checked by the engine's
    own start-up check (engine/layout.py check_dspark); None when another method drafts, or none."""
    speculative = config.runtime.speculative_config
    if speculative is None or speculative.method != "dspark":
        return None
    path = draft_config_json(speculative.model)
    try:
        return check_dspark(config, model_config, path), path
    except EngineConfigError as error:
        raise ConfigFileError(str(error)) from None


def plan_device(config: ServeConfig) -> str:
    """runtime.device; "auto" plans a GPU rig when the YAML gives the GPU's memory (serving asks torch)."""
    wanted = config.runtime.device
    if wanted == "auto":
        return "cuda" if config.memory.gpu_memory_gb else "cpu"
    if wanted == "cuda" and not config.memory.gpu_memory_gb:
        raise ConfigFileError("memory.gpu_memory_gb: planning a cuda rig needs the memory of one GPU (GiB)")
    return wanted


def engram_plan(model_config: ModelConfig, config: ServeConfig, device: str, ranks: int) -> EngramPlan | None:
    """Each table's bytes where its residency keeps it (RESIDENCIES' `table_in`): on the device
    (split across ranks), in host RAM, or in a file read through the row caches (which then count)."""
    spec = model_config.engram
    if spec is None:
        return None
    rows = spec.num_embeddings if all(spec.num_embeddings) else spec.layout.num_embeddings
    scale_bytes = spec.head_dim // 32
    row_bytes = spec.head_dim + scale_bytes
    section = config.engram
    layers = tuple((layer, n, section.layers[layer].residency if layer in section.layers else section.residency)
                   for layer, n in zip(spec.layer_ids, rows))
    table = {"device": 0, "host": 0, "file": 0}
    for _, n, residency in layers:
        table[RESIDENCIES[residency].table_in] += n * row_bytes
    file_rows = table["file"] // row_bytes
    caches = file_rows > 0
    device_bytes = -(-table["device"] // ranks) + (int(section.gpu_cache_gb * GiB) if caches else 0)
    host_bytes = table["host"] + (int(section.host_cache_gb * GiB) if caches else 0)
    host_bytes += file_rows * scale_bytes if section.resident_scales else 0
    if device == "cpu":  # the compute device is the host: every resident byte is RAM
        host_bytes, device_bytes = host_bytes + device_bytes, 0
    return EngramPlan(layers, row_bytes, device_bytes, host_bytes, table["file"])


def workspace_estimate(model_config: ModelConfig, config: ServeConfig) -> tuple[int, int]:
    """(activations, logits buffers) of the largest step. Activations: float32, one layer at a time,
    per token: the mHC streams (3 copies), then the larger of attention (queries and output, window +
    top-k scores and probabilities, indexer queries and scores) and the MoE (each chosen expert's
    gate/up/hidden rows). Logits: the runner's buffer, and with the prefix cache each slot's last row."""
    m, sched = model_config, config.scheduler
    streams = 3 * m.hc_mult * m.hidden_size
    attention = 2 * m.num_heads * m.head_dim + 2 * m.num_heads * (m.sliding_window + m.index_topk)
    attention += m.index_n_heads * (m.index_head_dim + m.index_topk)
    moe = m.num_experts_per_tok * 3 * m.moe_intermediate_size + 2 * m.hidden_size
    activations = sched.max_num_batched_tokens * FP32 * (streams + max(attention, moe))
    logits = max(sched.max_num_batched_tokens, sched.max_num_seqs) * m.vocab_size * FP32
    if sched.snapshot_slots:
        logits += (sched.max_num_seqs + sched.snapshot_slots) * m.vocab_size * FP32
    return activations, logits


def cache_bytes(model_config: ModelConfig, config: ServeConfig, dtype: torch.dtype, max_len: int) -> tuple[int, int, int]:
    """(bytes per page, fixed state of every slot, the host tier's bytes per page): the engine's own
    cache, allocated on the meta device."""
    sched = config.scheduler
    unit = page_granularity(model_config)
    if sched.block_tokens % unit:
        raise ConfigFileError(f"scheduler.block_tokens {sched.block_tokens} must be a multiple of {unit} for this"
                              " model (its compress rates)")
    try:
        check_kv_cache_dtype(config, model_config)
    except EngineConfigError as error:
        raise ConfigFileError(str(error)) from error
    try:
        cache = meta_cache(config, model_config, dtype, max_len)
    except ValueError as error:
        raise ConfigFileError(f"memory.kv_cache_dtype: {error}") from error
    return cache.page_bytes(), cache.slot_bytes(), cache.host_tier_page_bytes()


def build_plan(config: ServeConfig, config_path: Path, model_json: Path) -> RigPlan:
    """Raises PlanRefused when the rig cannot hold the config, ConfigFileError when the config is wrong."""
    unplannable = [f for f in unbuilt_features(config) if not f.plannable]
    if unplannable:
        raise PlanRefused(_without(config, config_path, model_json, unplannable))
    device, ranks = plan_device(config), config.parallel.tensor_parallel_size
    dtype = resolve_dtype(config, device)
    if config.runtime.drafts_with_mtp:  # the engine's check, so what it would refuse is refused by its key
        try:
            check_mtp(config, ModelConfig.from_file(model_json), model_json)
        except (EngineConfigError, ConfigError) as error:
            raise ConfigFileError(str(error)) from error
    try:
        model_config, weights = weight_tensors(model_json, config.model.quantization, dtype,
                                               config.model.load_format, mtp=config.runtime.drafts_with_mtp)
    except ConfigError as exc:
        raise ConfigFileError(str(exc)) from None
    draft = dspark_draft(config, model_config)
    if draft is not None:
        try:
            weights += draft_tensors(draft[0], draft[1], config.model.quantization, dtype)
        except CheckpointError as exc:  # its quantization_config
            raise ConfigFileError(f"runtime.speculative_config.model (--speculative-config): {exc}") from None
    max_len = max_model_len(config, model_config)
    page_bytes, slot_state, host_tier_page_bytes = cache_bytes(model_config, config, dtype, max_len)
    draft_state = draft_state_bytes(config, model_config, dtype, max_len, draft[0] if draft else None)
    slot_state += draft_state
    activations, logits = workspace_estimate(model_config, config)
    engram = engram_plan(model_config, config, device, ranks)
    budget, host_budget = budgets(config, device, ranks)
    fixed = sum(t.per_rank(ranks) for t in weights) + (engram.device_bytes if engram else 0)
    if device == "cpu" and engram:  # the host's RAM is the compute device's memory
        fixed += engram.host_bytes // ranks
    name = model_json.parent.name
    experts, host_left = None, host_budget  # host RAM not taken by host-resident experts
    if config.offload.experts == "host":
        experts = expert_placement(config, model_config, weights, budget, fixed, activations + logits,
                                   slot_state, page_bytes - host_tier_page_bytes, max_len)
        routed = sum(t.per_rank(ranks) for t in weights if t.kind == ROUTED)
        if device == "cpu":  # both tiers are the host's RAM: every expert stays counted, plus the staging ring
            fixed += experts.staging_bytes
        else:
            fixed += experts.gpu_bytes + experts.staging_bytes - routed
            host_left -= ranks * experts.host_bytes  # each rank's share of the host-resident experts
        if host_left < 0:
            raise PlanRefused(
                f"{name}: the host-resident routed experts need {_size(ranks * experts.host_bytes)} of pinned host RAM"
                f" ({experts.host_per_layer} a layer), {_size(-host_left)} over memory.host_memory_gb"
                f" {config.memory.host_memory_gb:g}: keep more on the GPU (offload.gpu_experts_per_layer /"
                " offload.gpu_experts_gb) or raise memory.host_memory_gb")
    _check_fixed(name, config, device, budget, fixed, activations + logits, slot_state, weights)
    try:
        kv = plan_pages(
            device=device, budget=budget, weights=fixed, workspace=activations + logits, slot_state=slot_state,
            page_bytes=page_bytes, block_tokens=config.scheduler.block_tokens,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_len, pinned_pages=config.memory.num_kv_pages,
            host_tier_page_bytes=host_tier_page_bytes,
            host_budget=(host_left - (engram.host_bytes if engram else 0)) // ranks,  # each rank keeps its pages
        )
    except MemoryPlanError as exc:
        raise PlanRefused(f"{name}: {exc}") from None
    if device == "cuda" and engram and engram.host_bytes > host_left:
        raise PlanRefused(
            f"the Engram tiers need {_size(engram.host_bytes)} of host RAM, memory.host_memory_gb"
            f" is {config.memory.host_memory_gb:g}: lower engram.host_cache_gb, keep fewer tables at residency host"
            " (engram.residency: disk), or raise memory.host_memory_gb"
        )
    records = prefix_records(config, model_config, dtype, max_len)
    try:
        tiers = prefix_tiers(config, records)
    except MemoryPlanError as exc:
        raise PlanRefused(f"{name}: {exc}") from None
    needs = tuple(str(f) for f in unbuilt_features(config))
    return RigPlan(config_path, model_json, model_config, device, ranks, dtype, config.model.quantization,
                   tuple(weights), engram, activations, logits, max_len, config.scheduler.max_num_seqs, kv, host_budget,
                   needs, records, tiers, experts, draft_state, draft[0] if draft else None)


def expert_placement(config: ServeConfig, model_config: ModelConfig, weights: list[WeightTensor],
                     budget: int, fixed: int, workspace: int, slot_state: int, gpu_page_bytes: int,
                     max_len: int) -> ExpertPlacement:
    """offload.experts host: the routed experts each rank keeps on the compute device and the ones in
    host RAM (engine/expert_placement.py). With no count in the config the device keeps as many as it
    holds after the other weights, the workspace, the slots' state and every sequence's full-length KV.
    On the CPU both tiers are the host's RAM: the split runs as on a GPU (the cache's mechanics), the
    memory is one."""
    offload, ranks = config.offload, config.parallel.tensor_parallel_size
    per_layer = model_config.n_routed_experts
    layers, expert_bytes = routed_expert_shape(weights, per_layer, ranks)
    routed = sum(t.per_rank(ranks) for t in weights if t.kind == ROUTED)
    sched = config.scheduler
    kv_full = sched.max_num_seqs * -(-max_len // sched.block_tokens) * gpu_page_bytes
    room = budget - (fixed - routed) - workspace - slot_state - kv_full
    try:
        placement = place_experts(offload, layers, per_layer, expert_bytes, room)
    except ValueError as exc:
        raise ConfigFileError(str(exc)) from None
    if placement.host_per_layer and placement.staging_slots < model_config.num_experts_per_tok:
        raise ConfigFileError(f"offload.staging_experts {offload.staging_experts}: a token routes to"
                              f" {model_config.num_experts_per_tok} experts a layer, which the staging ring must hold")
    return placement


def budgets(config: ServeConfig, device: str, ranks: int) -> tuple[int, int]:
    """(bytes each rank may fill, host RAM): a share of one GPU as the engine takes it
    (engine/memory_plan.py), or on the CPU the host's RAM split among the ranks."""
    host = int(config.memory.host_memory_gb * GiB)
    if device == "cuda":
        return int(config.memory.gpu_memory_gb * GiB * config.memory.gpu_memory_utilization), host
    return host // ranks, host


def _check_fixed(name: str, config: ServeConfig, device: str, budget: int, fixed: int, workspace: int,
                 slot_state: int, weights: list[WeightTensor]) -> None:
    """Refuses, with the shortfall and what would close it, a rig whose fixed bytes leave no room for KV."""
    needed = fixed + workspace + slot_state
    if needed <= budget:
        return
    ranks, memory = config.parallel.tensor_parallel_size, config.memory
    experts = sum(t.per_rank(ranks) for t in weights if t.kind == "routed experts")
    if device == "cuda":
        where = (f"memory.gpu_memory_gb {memory.gpu_memory_gb:g} x memory.gpu_memory_utilization"
                 f" {memory.gpu_memory_utilization:g}")
        fixes = ["more or larger GPUs (parallel.tensor_parallel_size, memory.gpu_memory_gb)"]
    else:
        where = f"memory.host_memory_gb {memory.host_memory_gb:g} over {ranks} rank(s)"
        fixes = ["more RAM (memory.host_memory_gb)"]
    if config.model.quantization == "none":
        fixes.append("weights kept as stored (model.quantization: checkpoint)")
    if config.offload.experts == "none":
        fixes.append("expert offload (offload.experts: host; the plan places it, serving it is not built yet)")
    else:
        fixes.append("fewer experts kept on the GPU (offload.gpu_experts_per_layer / offload.gpu_experts_gb)")
    drafts = sum(t.per_rank(ranks) for t in weights if t.kind in DRAFT_KINDS)
    if drafts:
        fixes.append(f"no draft layers (runtime.speculative_config: {_size(drafts)} of weights per rank, and their"
                     " state in the slot state)")
    raise PlanRefused(
        f"{name} does not fit: per rank, weights and resident Engram {_size(fixed)} + workspace {_size(workspace)}"
        f" + slot state {_size(slot_state)} = {_size(needed)}, over the budget of {_size(budget)} ({where}) by"
        f" {_size(needed - budget)}, before any KV page. Routed experts are {_size(experts)} of it; it needs "
        + ", or ".join(fixes)
    )


def _without(config: ServeConfig, config_path: Path, model_json: Path, unplannable: list[Unbuilt]) -> str:
    """Why an unbuilt feature stops the plan, and whether the rig would fit without it."""
    asked = "; ".join(str(f) for f in unplannable)
    try:
        build_plan(config.model_copy(update={"offload": OffloadSection()}), config_path, model_json)
    except PlanRefused as exc:
        return f"{asked}; so it cannot be planned with it, and without it {exc}"
    return f"{asked}; without it the rig fits (set it to none)"


def offload_placement(config: ServeConfig) -> ExpertPlacement | None:
    """The expert placement `python -m server plan` makes for `config` (None without offload.experts
    host): what the engine offloads at start."""
    if config.offload.experts != "host":
        return None
    model_json = model_config_json(config)
    return build_plan(config, model_json, model_json).experts


def _offload_note(plan: RigPlan) -> str:
    """With expert offload, where the routed experts are (after the per-rank weights figure)."""
    e = plan.experts
    if e is None:
        return ""
    return (f"   routed experts: {e.gpu_per_layer} of {e.experts_per_layer} a layer resident"
            f" ({_size(e.gpu_bytes)}), a staging ring of {e.staging_slots if e.host_per_layer else 0}"
            f" ({_size(e.staging_bytes)}); {e.host_per_layer} a layer in pinned host RAM ({_size(e.host_bytes)})")


def _host_tier_lines(kv: MemoryPlan) -> list[str]:
    """The KV host tier's share of each page (offload.kv: host_packed), when there is one."""
    if not kv.host_tier_page_bytes:
        return []
    where = "in host RAM" if kv.device == "cuda" else "of the KV above (on the CPU both tiers are host RAM)"
    return [(f"  KV host tier          {_gib(kv.num_pages * kv.host_tier_page_bytes)}   {kv.host_tier_page_bytes:,} B per page"
             f" ({kv.host_tier_page_bytes / kv.block_tokens:,.0f} B per token) {where}")]


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _gib(n: int) -> str:
    return f"{_size(n):>12}"


def describe(plan: RigPlan) -> str:
    """The plan as a person reads it: one line per purpose."""
    m, kv, r = plan.model_config, plan.kv, plan.ranks
    used = kv.weights_bytes + kv.workspace_bytes + kv.slot_state_bytes + kv.kv_bytes
    held = "as stored (FP8 / MXFP4)" if plan.quantization == "checkpoint" else f"dequantized to {str(plan.dtype)[6:]}"
    lines = [
        f"memory plan for {plan.config_path}",
        f"model       {plan.model_json.parent.name} ({m.model_type}, {m.num_layers} layers) from {plan.model_json}",
        (f"rig         {r} x {plan.device}, budget {_size(kv.budget_bytes)} per rank;"
         f" host RAM {_size(plan.host_budget_bytes)}"),
        (f"weights     {_size(plan.weights_bytes)} ({plan.weights_bytes:,} bytes on the meta device), {held};"
         f" per rank {_size(plan.weights_per_rank)}"),
    ]
    for kind, _ in KINDS:
        group = [t for t in plan.weights if t.kind == kind]
        if group:
            total, per_rank = sum(t.nbytes for t in group), sum(t.per_rank(r) for t in group)
            lines.append(f"  {kind:<22}{_gib(total)}   per rank {_gib(per_rank)}")
    lines += [
        "per rank",
        f"  weights               {_gib(plan.gpu_weights_per_rank)}" + _offload_note(plan),
        f"  Engram (resident)     {_gib(kv.weights_bytes - plan.gpu_weights_per_rank)}   tables, row caches in this memory",
        (f"  workspace (estimate)  {_gib(plan.activations_bytes + plan.logits_bytes)}   activations"
         f" {_size(plan.activations_bytes)} + logits {_size(plan.logits_bytes)}; the server measures it at start"),
        (f"  slot state            {_gib(kv.slot_state_bytes)}   windows, open groups, look-back: every slot"
         + _draft_state_note(plan)),
        (f"  KV                    {_gib(kv.kv_bytes)}   {kv.num_pages:,} pages x {kv.page_bytes:,} B"
         f" = {kv.num_pages * kv.block_tokens:,} tokens ({kv.page_bytes / kv.block_tokens:,.0f} B per token)"),
        *_host_tier_lines(kv),
        f"  sequences             {_sequences(plan)}",
        f"  free                  {_gib(kv.budget_bytes - used)}",
    ]
    lines += _engram_lines(plan)
    lines += _prefix_tier_lines(plan)
    lines.append("needs       " + ("; ".join(plan.needs) if plan.needs else "nothing unbuilt"))
    lines.append("fits        yes")
    return "\n".join(lines)


def _draft_state_note(plan: RigPlan) -> str:
    """What of the slot state the draft proposer holds (after the slot state figure)."""
    if plan.dspark is not None:
        d = plan.dspark
        return (f"; the DSpark rings {_size(plan.draft_state_bytes)} of it ({d.stages} stages x {plan.max_num_seqs}"
                f" + 1 slots x {d.layers.sliding_window} rows x {d.layers.head_dim} x {plan.dtype.itemsize} B;"
                " the one: the draft graphs' scratch slot)")
    if plan.draft_state_bytes:
        return f"; the MTP draft layer's cache {_size(plan.draft_state_bytes)} of it"
    return ""


def _sequences(plan: RigPlan) -> str:
    per_sequence = -(-plan.max_model_len // plan.kv.block_tokens)
    full = min(plan.kv.num_pages // per_sequence, plan.max_num_seqs)
    return (f"{full} of scheduler.max_num_seqs {plan.max_num_seqs} can reach model.max_model_len"
            f" {plan.max_model_len:,} at once")


def _engram_lines(plan: RigPlan) -> list[str]:
    e = plan.engram
    if e is None:
        return ["Engram      none (this model has no Engram layers)"]
    tiers = ", ".join(f"layer {layer}: {rows:,} rows on {residency}" for layer, rows, residency in e.layers)
    return [
        f"Engram      {tiers}; {e.row_bytes} B per row",
        f"  host RAM              {_gib(e.host_bytes)}   resident tables, row cache, resident scales",
        f"  NVMe                  {_gib(e.disk_bytes)}   table files of disk-resident layers",
    ]


def _prefix_tier_lines(plan: RigPlan) -> list[str]:
    """The prefix cache's tiers below the GPU (prefix_cache), per rank: records and their bytes."""
    t, r = plan.prefix_tiers, plan.records
    if not t.host:
        return ["prefix tiers off (prefix_cache.host_gb 0)"]
    lines = [(f"prefix tiers per rank: a slot record {r.slot_bytes:,} B (fixed state, last logits), a page record"
              f" {r.page_bytes:,} B ({plan.kv.block_tokens} tokens)")]
    tiers = [("host RAM", t.host_slots, t.host_pages, r.slot_bytes, r.page_bytes, "pinned")]
    if t.disk:
        tiers.append(("NVMe", t.disk_slots, t.disk_pages, r.disk_slot_bytes, r.disk_page_bytes,
                      "records in sealed 4 KiB pages"))
    for where, slots, pages, slot_bytes, page_bytes, how in tiers:
        lines.append(f"  {where:<22}{_gib(slots * slot_bytes + pages * page_bytes)}   {slots:,} slots + {pages:,} pages"
                     f" = {pages * plan.kv.block_tokens:,} tokens, {how}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m server plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="rig YAML (default configs/cpu-tiny.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key")
    parser.add_argument("--model-config",
                        help="config.json to plan with (default: the checkpoint's, else configs/models/<its name>/)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config_path = Path(args.config) if args.config else DEFAULT_CONFIG
    try:
        config = load_config(config_path, args.set)
        plan = build_plan(config, config_path, model_config_json(config, args.model_config))
    except ConfigFileError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except PlanRefused as exc:
        print(f"refused: {config_path}: {exc}", file=sys.stderr)
        return 1
    print(describe(plan))
    return 0


__all__ = ["PlanRefused", "RigPlan", "build_plan", "describe", "main", "model_config_json"]
