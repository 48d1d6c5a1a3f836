"""Builds the engine (model, runner, scheduler) from a validated config.

The one place that turns config sections into engine objects; the engine process (engine/process.py)
and the tensor-parallel ranks call it. Front-end code never imports it: what the front end needs of
the model travels in EngineReady (ModelFacts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from contract import EngineLimits, ModelFacts, PrefixTierLimits
from contract.config import DEFAULT_MODEL_DIR
from contract.model_files import TOKENIZER, borrows_default_tokenizer, tokenizer_dir
from engine.admission import MemoryPlan, plan_pages
from engine.layout import (
    EngineConfigError,
    cache_dtype,
    check_kv_cache_dtype,
    check_speculative,
    hot_tokens,
    max_model_len,
    prefix_records,
    prefix_tiers,
    resolve_device,
    resolve_dtype,
)
from engine.loop import EngineCore, OutputSink
from engine.memory_plan import GiB, RecordLayout, budget_bytes, model_bytes, profile_pages, profile_workspace
from engine.plan import offload_placement
from engine.prefix_catalog import (
    CATALOG,
    FIX,
    CatalogWriter,
    DirectoryLock,
    Fingerprint,
    PrefixCatalogError,
    checkpoint_parts,
    digest,
    load_catalog,
)
from engine.structured_outputs import GrammarVocabulary, StructuredOutputs
from engram_store.build import RESIDENCIES
from engram_store.store import EngramOptions
from models import SINGLE, ModelConfig, TensorParallel, load_model
from models.cache import page_granularity, stored_kv_cache_dtype
from models.dspark import attach_dspark
from models.dummy_weights import build_dummy_model
from models.expert_offload import LayerOffload
from models.layers import prefill_in_fp8
from scheduler import Scheduler
from scheduler.prefix_tiers import DiskEntry
from worker.proposers import DraftProposer, build_proposer
from worker.runner import ModelRunner
from worker.tensor_parallel import WorkerPool, external_rank_main

if TYPE_CHECKING:
    from contract.config import ServeConfig

log = logging.getLogger("ds4serve.engine")


@dataclass(frozen=True)
class EngineSpec:
    """What the front end needs to know about the engine it talks to."""

    max_model_len: int
    device: str
    dtype: str
    memory: MemoryPlan
    model: ModelFacts


def model_facts(model_config: ModelConfig) -> ModelFacts:
    return ModelFacts(model_type=model_config.model_type, bos_token_id=model_config.bos_token_id,
                      eos_token_ids=tuple(model_config.eos_token_ids))


def engram_options(config: "ServeConfig") -> EngramOptions:
    section = config.engram
    return EngramOptions(
        residency=section.residency,
        layer_residency={layer: override.residency for layer, override in section.layers.items()},
        path=Path(section.path) if section.path else None,
        host_cache_bytes=int(section.host_cache_gb * 2**30),
        gpu_cache_bytes=int(section.gpu_cache_gb * 2**30),
        queue_depth=section.queue_depth,
        resident_scales=section.resident_scales,
    )


def build_engine_core(config: "ServeConfig", on_outputs: OutputSink) -> tuple[EngineCore, EngineSpec]:
    """The engine over a worker pool of `parallel.tensor_parallel_size` ranks (this process is rank 0).
    With the prefix cache's disk tier, its catalog is read (and a foreign one refused) before the model
    loads, and seeds the scheduler."""
    model_config = ModelConfig.from_file(config.model_dir / "config.json")
    max_len = max_model_len(config, model_config)
    check_tokenizer(config, model_config)
    check_block_tokens(config, model_config)
    check_kv_cache_dtype(config, model_config)
    check_speculative(config, model_config)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    check_fp8_prefill(config, device, dtype)
    records = prefix_records(config, model_config, dtype, max_len)
    tiers = prefix_tiers(config, records)
    disk = read_disk_catalog(config, model_config, records, dtype) if tiers.disk else None
    pool = WorkerPool(config, partial(build_runner, config), device)
    sched = config.scheduler
    limits = EngineLimits(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=max_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=model_config.eos_token_ids,
        num_pages=pool.num_pages,
        block_tokens=sched.block_tokens,
        prefix_snapshots=sched.snapshot_slots,
        prefix_tiers=tiers,
    )
    vocabulary = GrammarVocabulary(tokenizer_dir(config) / TOKENIZER, model_config.vocab_size,
                                   model_config.eos_token_ids, model_config.model_type)
    scheduler = Scheduler(limits)
    speculative = config.runtime.speculative_config
    if speculative is None or not speculative.adaptive:
        scheduler.spec_policy = None  # every proposed draft is verified (or none is proposed)
    catalog = seed_disk_tier(scheduler, tiers, prefix_dir(config), *disk) if disk is not None else None
    engine = EngineCore(scheduler, pool, on_outputs, StructuredOutputs(vocabulary), catalog,
                        overlap=config.scheduler.async_scheduling)
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("engine for %s on %s (%s), %d rank(s)", config.model_dir, device, dtype_name, pool.world)
    return engine, EngineSpec(max_model_len=max_len, device=device, dtype=dtype_name, memory=pool.memory_plan,
                              model=model_facts(model_config))


def serve_external_rank(config: "ServeConfig") -> int:
    """`python -m server` as rank >= 1 under torchrun: this rank's runner, fed by rank 0's plans."""
    return external_rank_main(config, partial(build_runner, config), resolve_device(config))


def check_tokenizer(config: "ServeConfig", model_config: ModelConfig) -> None:
    """A dummy directory without a tokenizer borrows the embedded default's only if its vocabulary is the
    model's: every id the model can sample decodes, and every id the tokenizer makes has an embedding."""
    if not borrows_default_tokenizer(config):
        return
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / TOKENIZER)).get_vocab_size(with_added_tokens=True)
    if size != model_config.vocab_size:
        raise EngineConfigError(
            f"model.load_format dummy: {config.model_dir} has no {TOKENIZER}, and the embedded default's tokenizer"
            f" ({size} tokens) does not fit this model's vocab_size {model_config.vocab_size}; give the model's"
            f" tokenizer with --tokenizer DIR (model.tokenizer), or copy its {TOKENIZER} into {config.model_dir}")
    log.info("model.load_format dummy: %s has no %s; using the embedded default's (%s)", config.model_dir,
             TOKENIZER, DEFAULT_MODEL_DIR)


def check_fp8_prefill(config: "ServeConfig", device: str, dtype: torch.dtype) -> None:
    """model.prefill_activations fp8 rounds bf16 activations to e4m3 for tensor cores that multiply it: a
    bf16 model on a GPU that has them (sm_89 on), or the key would do nothing."""
    if config.model.prefill_activations != "fp8":
        return
    if not str(device).startswith("cuda") or torch.cuda.get_device_capability(device) < (8, 9):
        raise EngineConfigError(
            f"model.prefill_activations fp8 needs an NVIDIA GPU with FP8 tensor cores (sm_89 or later); this engine "
            f"runs on {device}: set it to model (the default)")
    if dtype != torch.bfloat16:
        raise EngineConfigError(f"model.prefill_activations fp8 rounds bf16 activations; model.dtype is {dtype}: "
                                "set it to bfloat16 (or auto)")


def check_block_tokens(config: "ServeConfig", model_config: ModelConfig) -> None:
    unit = page_granularity(model_config)
    if config.scheduler.block_tokens % unit:
        raise EngineConfigError(
            f"scheduler.block_tokens {config.scheduler.block_tokens} must be a multiple of {unit} for this model "
            "(its compress rates)"
        )


def build_proposer_for(config: "ServeConfig", model: torch.nn.Module) -> DraftProposer | None:
    """The runner's draft proposer (None without --speculative-config)."""
    speculative = config.runtime.speculative_config
    if speculative is None:
        return None
    low, high = speculative.lookup_sizes
    return build_proposer(speculative.method, model, config.scheduler.max_num_seqs, max_model_len(config, model.config),
                          speculative.num_speculative_tokens, prompt_lookup_min=low, prompt_lookup_max=high,
                          confidence_threshold=speculative.confidence_threshold or 0.0)


def graphs_on(config: "ServeConfig") -> bool:
    """Whether decode steps replay CUDA graphs: not with --enforce-eager, nor with expert offload, whose
    cache reads each step's routing on the host (models/expert_offload.py)."""
    return not config.runtime.enforce_eager and config.offload.experts == "none"


def prefix_dir(config: "ServeConfig") -> Path | None:
    """The disk tier's directory (None with the disk tier off)."""
    return Path(config.prefix_cache.dir) if config.prefix_cache.disk_gb > 0 and config.prefix_cache.dir else None


def catalog_fingerprint(config: "ServeConfig", model_config: ModelConfig, records: RecordLayout,
                        dtype: torch.dtype) -> Fingerprint:
    """What the disk tier's records depend on: the checkpoint (its files, engine/prefix_catalog.py), and
    what decides their bytes or what the bytes mean: the model dtype (bf16 and fp16 records are the same
    size), the paged stores' kv_cache_dtype, the tokens a page covers, each record tensor's row shape and
    dtype in record order, the record sizes, the rank count. Not max_num_seqs, max_model_len or the
    budgets (a record is one slot's or one page's whatever their number; a smaller tier drops the entries
    past its end), nor runtime.deterministic or model.quantization (they compute the same state up to
    rounding, as any two batch shapes do)."""
    return Fingerprint.of({
        **checkpoint_parts(config.model_dir),
        **weight_parts(config),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": stored_kv_cache_dtype(model_config, cache_dtype(config)),
        "block_tokens": str(config.scheduler.block_tokens),
        "slot record bytes": str(records.slot_bytes),
        "page record bytes": str(records.page_bytes),
        "record tensors": digest("\n".join(records.tensors).encode()),
        "tensor_parallel_size": str(config.parallel.tensor_parallel_size),
    })


def weight_parts(config: "ServeConfig") -> dict[str, str]:
    """The fingerprint's parts beside the checkpoint's files: for dummy weights what draws them (the
    seed, the generator's device type, and the format: released weights are rounded), and a tokenizer from
    elsewhere (V4.1's Engram hashing reads it). None for a checkpoint served with its own tokenizer, so
    the catalogs written before these parts existed stay valid."""
    parts = {}
    if config.model.load_format == "dummy":
        parts = {"load_format": "dummy", "seed": str(config.model.seed), "generator": resolve_device(config),
                 "quantization": config.model.quantization}
    source = tokenizer_dir(config)
    if source != config.model_dir:
        parts[TOKENIZER] = digest((source / TOKENIZER).read_bytes())
    return parts


def read_disk_catalog(config: "ServeConfig", model_config: ModelConfig, records: RecordLayout,
                      dtype: torch.dtype) -> tuple[Fingerprint, list[DiskEntry], DirectoryLock]:
    """Creates prefix_cache.dir if missing, locks it (PrefixCatalogError if another server holds it),
    then reads its catalog (PrefixCatalogError for a foreign or unreadable one)."""
    directory = prefix_dir(config)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EngineConfigError(f"prefix_cache.dir {directory}: cannot create it: {exc.strerror}") from exc
    fingerprint = catalog_fingerprint(config, model_config, records, dtype)
    lock = DirectoryLock(directory)
    try:
        return fingerprint, load_catalog(directory, fingerprint), lock
    except Exception:
        lock.release()
        raise


def seed_disk_tier(scheduler: Scheduler, tiers: PrefixTierLimits, directory: Path, fingerprint: Fingerprint,
                   entries: list[DiskEntry], lock: DirectoryLock | None = None) -> CatalogWriter:
    """The scheduler's disk tier from the catalog's entries (those within this budget's records: a lower
    prefix_cache.disk_gb drops the ones past its end), and the writer that keeps the catalog from now on."""
    kept = [e for e in entries if e.slot < tiers.disk_slots and all(p < tiers.disk_pages for p in e.pages)]
    if len(kept) < len(entries):
        log.info("prefix disk tier: %d of the catalog's %d points lie past prefix_cache.disk_gb's records: dropped",
                 len(entries) - len(kept), len(entries))
    try:
        scheduler.seed_disk(kept)
    except ValueError as exc:
        if lock is not None:
            lock.release()
        raise PrefixCatalogError(f"{directory / CATALOG}: inconsistent prefix catalog ({exc}); {FIX}") from exc
    log.info("prefix disk tier: %d state points from %s", len(kept), directory)
    return CatalogWriter(directory, fingerprint, scheduler.disk_version, lock=lock)


def build_runner(
    config: "ServeConfig", plan_group: dist.ProcessGroup | None = None, num_pages: int | None = None
) -> tuple[ModelRunner, MemoryPlan | None]:
    """This rank's model and runner. Without `num_pages` the memory plan sizes the cache; with several
    ranks they agree on the smallest page count (over `plan_group`), since every rank holds the same
    pages. A restart passes the page count the scheduler already uses."""
    device = resolve_device(config)
    tp = TensorParallel.from_default_group() if plan_group is not None else None
    if tp is not None and device == "cuda":
        device = f"cuda:{tp.rank}"
    dtype = resolve_dtype(config, device)
    model_config = ModelConfig.from_file(config.model_dir / "config.json")
    max_len = max_model_len(config, model_config)
    options = engram_options(config)
    # a tier that reads table files converts missing ones on first use: rank 0 does it, the others wait
    converts_first = plan_group is not None and any(RESIDENCIES[r].reads_files for r in options.residencies())
    if converts_first and tp.rank != 0:
        dist.barrier(group=plan_group)
    model = load_weights(config, dtype, device, options, tp or SINGLE)
    if converts_first and tp.rank == 0:
        dist.barrier(group=plan_group)
    sched = config.scheduler
    tiers = prefix_tiers(config, prefix_records(config, model_config, dtype, max_len))
    memory_plan = None
    if num_pages is None:
        memory_plan = _memory_plan(config, model, device, max_len)
        log.info(memory_plan.describe())
        num_pages = memory_plan.num_pages
        if plan_group is not None:
            agreed = torch.tensor([num_pages])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=plan_group)
            num_pages = int(agreed.item())
    runner = ModelRunner(
        model, sched.max_num_seqs, max_len, device=device, num_pages=num_pages, block_tokens=sched.block_tokens,
        max_logit_rows=sched.max_num_batched_tokens, deterministic=config.runtime.deterministic,
        snapshot_slots=sched.snapshot_slots, tp=tp or SINGLE, cuda_graphs=graphs_on(config),
        kv_cache_dtype=cache_dtype(config), kv_hot_tokens=hot_tokens(config),
        prefix_tiers=tiers, prefix_dir=prefix_dir(config), rank=tp.rank if tp is not None else 0,
        draft_tokens=config.runtime.draft_tokens, proposer=build_proposer_for(config, model),
    )
    return runner, memory_plan


def load_weights(config: "ServeConfig", dtype: torch.dtype, device: str, options: EngramOptions,
                 tp: TensorParallel) -> torch.nn.Module:
    """This rank's model: read from the checkpoint (model.load_format auto) or drawn (dummy), held as
    model.quantization says."""
    held_as_stored = config.model.quantization == "checkpoint"
    mtp = config.runtime.drafts_with_mtp
    placement = offload_placement(config)
    # expert offload: each layer's experts leave the device as they arrive (the device never holds them all)
    offload = None if placement is None else LayerOffload(placement.gpu_per_layer, placement.staging_slots)
    if config.model.load_format == "dummy":
        model = build_dummy_model(config.model_dir, config.model.seed, dtype, device, released=held_as_stored,
                                  engram=options, tp=tp, tokenizer_dir=tokenizer_dir(config), mtp=mtp,
                                  experts_loaded=offload)
    else:
        model = load_model(config.model_dir, dtype=dtype, device=device, engram=options, tp=tp,
                           keep_quantized=held_as_stored, tokenizer_dir=tokenizer_dir(config), mtp=mtp,
                           experts_loaded=offload)
    if offload is not None:
        log.info("expert offload: %d of %d routed experts a layer resident, %d staging slots, %d layers",
                 placement.gpu_per_layer, placement.experts_per_layer, placement.staging_slots, offload.layers)
    speculative = config.runtime.speculative_config
    if speculative is not None and speculative.method == "dspark":  # after the offload: its experts stay resident
        attach_dspark(model, Path(speculative.model), tp, keep_quantized=held_as_stored)
    if config.model.prefill_activations == "fp8":
        log.info("prefill activations in fp8: %d modules (routed experts, FP8 linears)", prefill_in_fp8(model))
    return model


def _memory_plan(config: "ServeConfig", model, device: str, max_len: int) -> MemoryPlan:
    """Profiles one largest step on a probe cache just big enough for it, then sizes the real one.
    The workspace counts the CUDA graph pool the probe's capture reserved (graphs are captured on it
    too, so the figure is measured, not guessed)."""
    sched = config.scheduler
    probe = ModelRunner(
        model, sched.max_num_seqs, max_len, device=device, block_tokens=sched.block_tokens,
        num_pages=profile_pages(sched.max_num_seqs, sched.max_num_batched_tokens, sched.block_tokens),
        max_logit_rows=sched.max_num_batched_tokens, deterministic=config.runtime.deterministic,
        snapshot_slots=sched.snapshot_slots, cuda_graphs=graphs_on(config),
        kv_cache_dtype=cache_dtype(config), kv_hot_tokens=hot_tokens(config),
        draft_tokens=config.runtime.draft_tokens, proposer=build_proposer_for(config, model),  # verify graphs, MTP cache
    )
    workspace = profile_workspace(probe, sched.max_num_seqs, sched.max_num_batched_tokens, max_len)
    if probe.graphs is not None:  # the decode graphs' pool: the real runner captures the same buckets
        workspace += probe.graphs.pool_bytes + probe.proposer_graph_bytes
    for buffer in (probe.logits, probe.last_logits):  # the runner's logits buffers
        if buffer is not None:
            workspace += buffer.numel() * buffer.element_size()
    page_bytes, slot_state = probe.cache.page_bytes(), probe.cache.slot_bytes()
    if probe.proposer is not None:  # an MTP draft layer's cache: the real runner's proposer holds the same
        slot_state += probe.proposer.device_bytes()
    host_tier_page_bytes = probe.cache.host_tier_page_bytes()
    del probe
    return plan_pages(
        device=device,
        budget=budget_bytes(device, config.memory.gpu_memory_utilization, config.memory.host_memory_gb),
        weights=model_bytes(model),
        workspace=workspace,
        slot_state=slot_state,
        page_bytes=page_bytes,
        block_tokens=sched.block_tokens,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=max_len,
        pinned_pages=config.memory.num_kv_pages,
        host_tier_page_bytes=host_tier_page_bytes,
        # every rank holds the same pages: the host tier's RAM is shared out among them
        host_budget=int(config.memory.host_memory_gb * GiB) // config.parallel.tensor_parallel_size,
    )
