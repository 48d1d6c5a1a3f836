"""The prefix cache's tiers below the GPU, the engine's side (docs/prefix-tiers.md): the prefix_cache
config section and what it refuses, the tier budgets in records (and that they are the records the
worker allocates), the disk catalog's fingerprint, file and writer, the loop persisting it, and an
engine restarted on its own disk tier. CPU, small files, the embedded tiny checkpoint."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from contract import NewRequest, PrefixTierLimits, SamplingParams
from contract.config import DEFAULT_MODEL_DIR, ConfigFileError, PrefixCacheSection, load_config
from engine.admission import MemoryPlanError
from engine.factory import build_engine_core, catalog_fingerprint, read_disk_catalog
from engine.layout import max_model_len, prefix_records, prefix_tiers, resolve_dtype
from engine.loop import EngineCore
from engine.memory_plan import GiB, RecordLayout, prefix_tier_limits, record_layout, split_tier
from engine.plan import PlanRefused, build_plan, describe, model_config_json
from engine.prefix_catalog import (
    BLOCK,
    CATALOG,
    CatalogWriter,
    Fingerprint,
    PrefixCatalogError,
    checkpoint_parts,
    encode,
    load_catalog,
    sample_offsets,
    write_catalog,
)
from engram_store.format import PAGE
from models import ModelConfig, load_model
from scheduler.prefix_tiers import DiskEntry
from worker import ModelRunner

BLOCK_TOKENS = 4


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rig.yaml"
    path.write_text(text)
    return path


# -- config --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("yaml_text, key, words", [
    ("prefix_cache: {host_gb: 1, disk_gb: 2}", "prefix_cache.dir", "required"),
    ("prefix_cache: {disk_gb: 2, dir: /tmp/x}", "prefix_cache.disk_gb", "through the host tier"),
    ("prefix_cache: {host_gb: 1}\nscheduler: {enable_prefix_caching: false}", "prefix_cache.host_gb",
     "scheduler.enable_prefix_caching is false"),
    ("prefix_cache: {disk_gb: 1, host_gb: 0, dir: /x}\nscheduler: {enable_prefix_caching: false}",
     "prefix_cache.disk_gb", "scheduler.enable_prefix_caching is false"),
    ("prefix_cache: {host_gb: -1}", "prefix_cache.host_gb", "greater than or equal to 0"),
    ("prefix_cache: {ram_gb: 1}", "prefix_cache.ram_gb", "unknown key"),
])
def test_config_refusals_name_the_key_and_the_file(tmp_path, yaml_text, key, words):
    path = config_file(tmp_path, yaml_text)
    with pytest.raises(ConfigFileError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: ") and f"{key}: " in str(error.value) and words in str(error.value)


def test_config_defaults_off_and_flags_are_named(tmp_path):
    assert load_config(config_file(tmp_path, "")).prefix_cache == PrefixCacheSection(host_gb=0, disk_gb=0, dir=None)
    on = load_config(config_file(tmp_path, "prefix_cache: {host_gb: 8, disk_gb: 64, dir: /nvme/p}"))
    assert (on.prefix_cache.host_gb, on.prefix_cache.disk_gb, on.prefix_cache.dir) == (8, 64, "/nvme/p")
    with pytest.raises(ConfigFileError, match=r"scheduler.enable_prefix_caching \(--enable-prefix-caching\) is false"):
        load_config(config_file(tmp_path, "prefix_cache: {host_gb: 1}"), flags={"enable_prefix_caching": False})


# -- budgets -------------------------------------------------------------------------------------------

V4_FLASH = RecordLayout(slot_bytes=11_700_000, page_bytes=880_000, tensors=())


def test_a_tier_gives_slots_a_quarter_and_pages_the_rest():
    slots, pages = split_tier(64 * GiB, V4_FLASH.slot_bytes, V4_FLASH.page_bytes, "k")
    assert slots == 64 * GiB // 4 // V4_FLASH.slot_bytes == 1468
    assert pages == (64 * GiB - slots * V4_FLASH.slot_bytes) // V4_FLASH.page_bytes
    assert pages // 512 == 114  # 64K-token conversations' pages
    assert split_tier(0, 10, 10, "k") == (0, 0)
    assert split_tier(25, 10, 10, "k") == (1, 1)  # a quarter holds no slot: one anyway
    with pytest.raises(MemoryPlanError, match=r"prefix_cache.host_gb: 15 B per rank hold no state point"):
        split_tier(15, 10, 10, "prefix_cache.host_gb")


def test_disk_records_are_sealed_4k_pages_and_ranks_share_host_ram():
    layout = RecordLayout(slot_bytes=4080, page_bytes=4081, tensors=())
    assert (layout.disk_slot_bytes, layout.disk_page_bytes) == (PAGE, 2 * PAGE)  # 4080 payload bytes a page
    tiers = prefix_tier_limits(PrefixCacheSection(host_gb=1, disk_gb=2, dir="/x"), 1, layout)
    assert (tiers.disk_slots, tiers.disk_pages) == split_tier(2 * GiB, PAGE, 2 * PAGE, "k")
    assert (tiers.host_slots, tiers.host_pages) == split_tier(GiB, 4080, 4081, "k") and tiers.disk
    per_rank = prefix_tier_limits(PrefixCacheSection(host_gb=1), 4, layout)
    assert (per_rank.host_slots, per_rank.host_pages) == split_tier(GiB // 4, 4080, 4081, "k") and not per_rank.disk
    assert prefix_tier_limits(PrefixCacheSection(), 1, layout) == PrefixTierLimits()


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_file(DEFAULT_MODEL_DIR / "config.json")


def test_the_budgets_are_the_records_the_worker_allocates(tiny):
    """The factory sizes the tiers from the cache layout on the meta device; the runner's host tier,
    given those limits, holds rows of exactly those record bytes."""
    config = load_config(None, ["prefix_cache.host_gb=0.002", "scheduler.max_num_seqs=2", "model.max_model_len=64",
                                f"scheduler.block_tokens={BLOCK_TOKENS * 4}"])
    dtype = resolve_dtype(config, "cpu")
    max_len = max_model_len(config, tiny)
    records = prefix_records(config, tiny, dtype, max_len)
    tiers = prefix_tiers(config, records)
    assert tiers.host and not tiers.disk
    model = load_model(DEFAULT_MODEL_DIR, dtype=dtype)
    sched = config.scheduler
    runner = ModelRunner(model, sched.max_num_seqs, max_len, block_tokens=sched.block_tokens,
                         snapshot_slots=sched.snapshot_slots, prefix_tiers=tiers)
    assert record_layout(runner.cache, tiny.vocab_size) == records
    host = runner.host_tier
    assert (host.slots, host.pages) == (tiers.host_slots, tiers.host_pages)
    assert sum(m.row_bytes for m in host.fixed) == records.slot_bytes
    assert sum(m.row_bytes for m in host.paged) == records.page_bytes
    assert host.nbytes <= int(0.002 * GiB) + 64 * (len(host.fixed) + len(host.paged))  # alignment padding only
    without_snapshots = load_config(None, ["scheduler.prefix_snapshots=0"])
    assert prefix_records(without_snapshots, tiny, dtype, max_len).slot_bytes == records.slot_bytes - 4 * tiny.vocab_size


def plan_of(*overrides: str):
    config = load_config(None, list(overrides))
    return build_plan(config, Path("rig.yaml"), model_config_json(config))


def test_the_plan_prints_each_tier_in_records_and_bytes():
    plan = plan_of("prefix_cache.host_gb=1", "prefix_cache.disk_gb=4", "prefix_cache.dir=/unused")
    t, r = plan.prefix_tiers, plan.records
    assert t == prefix_tier_limits(PrefixCacheSection(host_gb=1, disk_gb=4, dir="/unused"), 1, r) and t.disk
    text = describe(plan)
    assert f"a slot record {r.slot_bytes:,} B" in text and f"a page record {r.page_bytes:,} B" in text
    assert f"{t.host_slots:,} slots + {t.host_pages:,} pages" in text
    assert f"{t.disk_slots:,} slots + {t.disk_pages:,} pages" in text and "sealed 4 KiB pages" in text
    assert "prefix tiers off (prefix_cache.host_gb 0)" in describe(plan_of())
    with pytest.raises(PlanRefused, match="prefix_cache.host_gb: .* hold no state point"):
        plan_of("prefix_cache.host_gb=0.00001")


# -- fingerprint ---------------------------------------------------------------------------------------

def fake_checkpoint(root: Path) -> Path:
    """config.json and a safetensors file of ~1 MiB (16 blocks: more than are sampled)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    save_file({"a": torch.arange(2**18, dtype=torch.float32), "b": torch.ones(4)}, str(root / "model.safetensors"))
    return root


def data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_fingerprint_is_stable_and_sees_config_header_and_sampled_data(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt")
    weights = root / "model.safetensors"
    first = checkpoint_parts(root)
    assert checkpoint_parts(root) == first
    assert set(first) == {"config.json", "safetensors files", "model.safetensors size", "model.safetensors header",
                          "model.safetensors data"}
    start, size = data_start(weights), weights.stat().st_size
    offsets = sample_offsets(start, size)
    assert offsets[0] == start and offsets[-1] == size - BLOCK and len(offsets) == 8

    flip(weights, offsets[3] + 100)  # a sampled byte
    sampled = checkpoint_parts(root)
    assert [k for k in first if sampled[k] != first[k]] == ["model.safetensors data"]
    flip(weights, offsets[3] + 100)
    unsampled = offsets[1] + BLOCK + 7  # between two sampled blocks: not read (checkpoints are 150 GB)
    assert unsampled < offsets[2]
    flip(weights, unsampled)
    assert checkpoint_parts(root) == first
    flip(weights, unsampled)

    data = weights.read_bytes()
    header = data[8:start].replace(b'"a"', b'"c"')  # same length, another tensor name
    weights.write_bytes(bytes(data[:8] + header + data[start:]))
    renamed = checkpoint_parts(root)
    assert [k for k in first if renamed[k] != first[k]] == ["model.safetensors header"]

    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 16}))
    assert checkpoint_parts(root)["config.json"] != first["config.json"]


def test_the_engine_fingerprint_names_the_cache_layout(tiny):
    config = load_config(None, ["prefix_cache.host_gb=1", "prefix_cache.disk_gb=1", "prefix_cache.dir=/unused"])
    records = prefix_records(config, tiny, torch.float32, 4096)
    parts = dict(catalog_fingerprint(config, tiny, records, torch.float32).parts)
    assert parts["dtype"] == "float32" and parts["block_tokens"] == "128" and parts["tensor_parallel_size"] == "1"
    assert parts["slot record bytes"] == str(records.slot_bytes) and "config.json" in parts
    more_seqs = load_config(None, ["scheduler.max_num_seqs=3", "model.max_model_len=1024"])
    assert catalog_fingerprint(more_seqs, tiny, records, torch.float32).parts == tuple(parts.items())
    bf16 = catalog_fingerprint(config, tiny, prefix_records(config, tiny, torch.bfloat16, 4096), torch.bfloat16)
    assert "dtype float32 -> bfloat16" in bf16.differences(Fingerprint.of(parts))


# -- the catalog file ----------------------------------------------------------------------------------

FINGERPRINT = Fingerprint.of({"config.json": "0" * 32, "dtype": "float32", "block_tokens": str(BLOCK_TOKENS)})
CHAT = tuple(range(100, 123))  # 5 full pages of 4 tokens and 3 more


def entries() -> list[DiskEntry]:
    """A chat's three points (each extends the one before, sharing its full pages), a branch off its
    first point, another tenant's same tokens, a point of no full page, and a seal of 63 bits."""
    big = 2**63 - 1
    return [
        DiskEntry("t1", CHAT[:8], True, 0, (10, 11), (big, 1, 2), 3),
        DiskEntry("t1", CHAT[:18], False, 1, (10, 11, 12, 13, 14), (7, 1, 2, 3, 4, 5), 0),
        DiskEntry("t1", CHAT, True, 2, (10, 11, 12, 13, 14, 15), (8, 1, 2, 3, 4, 6, 9), 12),
        DiskEntry("t1", CHAT[:8] + (5, 5), False, 3, (10, 11, 16), (9, 1, 2, 10), 1),
        DiskEntry(None, CHAT[:8], True, 4, (20, 21), (11, 12, 13), 0),
        DiskEntry(None, (1, 2), False, 5, (22,), (14, 15), 2**40),
    ]


def test_a_catalog_round_trips_and_stores_a_chat_once(tmp_path):
    write_catalog(tmp_path, FINGERPRINT, entries())
    assert sorted(load_catalog(tmp_path, FINGERPRINT), key=lambda e: e.slot) == entries()
    assert not (tmp_path / (CATALOG + ".tmp")).exists()
    front_coded = len(encode(FINGERPRINT, entries()))
    stored_alone = sum(len(encode(FINGERPRINT, [e])) for e in entries())
    assert front_coded < stored_alone - 5 * len(encode(FINGERPRINT, []))  # the chat's points share
    write_catalog(tmp_path, FINGERPRINT, [])
    assert load_catalog(tmp_path, FINGERPRINT) == []


def test_a_missing_catalog_starts_empty_and_marks_the_directory(tmp_path):
    assert load_catalog(tmp_path, FINGERPRINT) == []
    assert (tmp_path / CATALOG).exists()
    other = Fingerprint.of({**dict(FINGERPRINT.parts), "dtype": "bfloat16"})
    with pytest.raises(PrefixCatalogError, match="dtype float32 -> bfloat16"):
        load_catalog(tmp_path, other)


def test_a_foreign_catalog_is_refused_naming_the_directory_and_what_differs(tmp_path):
    write_catalog(tmp_path, FINGERPRINT, entries())
    other = Fingerprint.of({"config.json": "1" * 32, "dtype": "bfloat16", "block_tokens": str(BLOCK_TOKENS),
                            "model-00002.safetensors size": "9"})
    with pytest.raises(PrefixCatalogError) as error:
        load_catalog(tmp_path, other)
    message = str(error.value)
    assert message.startswith(f"prefix_cache.dir {tmp_path}: ")
    assert "(differs: config.json, dtype float32 -> bfloat16, model-00002.safetensors size (not in the catalog's))" in message
    assert "delete the directory, or point prefix_cache.dir elsewhere" in message


@pytest.mark.parametrize("damage, why", [
    (lambda data: data[:-1], "body bytes"),
    (lambda data: data[:-3] + bytes([data[-3] ^ 1]) + data[-2:], "checksum mismatch"),
    (lambda data: b"NOTACATL" + data[8:], "bad magic"),
    (lambda data: data[:12] + b"x" + data[13:], "unreadable header"),
    (lambda data: data[:10], "bad magic"),
])
def test_a_damaged_catalog_is_refused_naming_the_file(tmp_path, damage, why):
    write_catalog(tmp_path, FINGERPRINT, entries())
    path = tmp_path / CATALOG
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(PrefixCatalogError) as error:
        load_catalog(tmp_path, FINGERPRINT)
    assert str(error.value).startswith(f"{path}: corrupt prefix catalog (") and why in str(error.value)


def test_the_factory_creates_the_directory_and_reads_its_catalog(tmp_path, tiny):
    directory = tmp_path / "nvme" / "prefix"
    config = load_config(None, ["prefix_cache.host_gb=1", "prefix_cache.disk_gb=1", f"prefix_cache.dir={directory}"])
    records = prefix_records(config, tiny, torch.float32, 4096)
    fingerprint, found, lock = read_disk_catalog(config, tiny, records, torch.float32)
    assert found == [] and (directory / CATALOG).exists()
    write_catalog(directory, fingerprint, entries())
    lock.release()  # a server's lock, held until its catalog writer closes
    _, found, lock = read_disk_catalog(config, tiny, records, torch.float32)
    assert len(found) == len(entries())
    lock.release()
    fp16 = load_config(None, ["prefix_cache.host_gb=1", "prefix_cache.disk_gb=1", f"prefix_cache.dir={directory}",
                              "model.dtype=float16"])
    with pytest.raises(PrefixCatalogError, match=r"dtype float32 -> float16"):
        read_disk_catalog(fp16, tiny, prefix_records(fp16, tiny, torch.float16, 4096), torch.float16)


# -- writing it ----------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def written(directory: Path) -> list[DiskEntry]:
    return sorted(load_catalog(directory, FINGERPRINT), key=lambda e: e.slot)


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_writer_writes_changes_at_most_once_a_second_and_the_last_on_close(tmp_path):
    write_catalog(tmp_path, FINGERPRINT, [])
    clock, asked = Clock(), []
    writer = CatalogWriter(tmp_path, FINGERPRINT, version=0, clock=clock)

    def snapshot(n: int):
        return lambda: asked.append(n) or entries()[:n]

    writer.offer(0, snapshot(9))  # unchanged: not even asked for
    clock.now = 0.5
    writer.offer(1, snapshot(1))  # too soon after the start
    assert asked == []
    clock.now = 1.0
    writer.offer(1, snapshot(1))
    wait_for(lambda: writer.written_version == 1)
    assert asked == [1] and written(tmp_path) == entries()[:1]
    clock.now = 1.5
    writer.offer(2, snapshot(2))  # held back by the rate limit ...
    writer.offer(3, snapshot(3), final=True)  # ... but not the last one
    writer.close()
    assert asked == [1, 3] and writer.written_version == 3 and written(tmp_path) == entries()[:3]


class DiskScheduler:
    """The loop's view of a scheduler with a disk tier and nothing to schedule."""

    has_work = False

    def __init__(self) -> None:
        self.disk_version, self._entries = 0, []

    def commit(self, new: list[DiskEntry]) -> None:
        self._entries, self.disk_version = new, self.disk_version + 1

    def disk_entries(self) -> list[DiskEntry]:
        return list(self._entries)

    def flush(self) -> None:
        """No GPU points to put on disk as the loop stops."""


class IdleExecutor:
    pending_inputs = False
    proposes_drafts = False

    def maintain(self) -> None:
        pass


def test_the_loop_persists_the_catalog_when_the_disk_set_changes_and_on_stop(tmp_path):
    write_catalog(tmp_path, FINGERPRINT, [])
    scheduler = DiskScheduler()
    writer = CatalogWriter(tmp_path, FINGERPRINT, version=0, interval_s=0.05)
    engine = EngineCore(scheduler, IdleExecutor(), lambda outputs: None, catalog=writer)  # type: ignore[arg-type]
    engine.start()
    try:
        scheduler.commit(entries()[:2])  # (a test's shortcut: the real scheduler changes on the loop thread)
        wait_for(lambda: writer.written_version == 1)  # idle: the loop wakes within 0.5 s and offers it
        assert written(tmp_path) == entries()[:2]
        scheduler.commit(entries())
    finally:
        engine.stop()
    assert writer.written_version == 2 and written(tmp_path) == entries()
    assert not any(t.name == "ds4serve-prefix-catalog" for t in threading.enumerate())


# -- the engine, end to end ----------------------------------------------------------------------------

def serve(config, prompts: list[tuple[int, ...]]):
    """An engine over `config` that runs `prompts` (greedy, two tokens each) and stops; returns it."""
    finished: list[str] = []
    engine, _ = build_engine_core(config, lambda outputs: finished.extend(o.request_id for o in outputs if o.finished))
    seeded = engine.scheduler.disk_entries()
    engine.start()
    try:
        for i, prompt in enumerate(prompts):
            engine.submit(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0)))
        wait_for(lambda: len(finished) == len(prompts), timeout=60)
        wait_for(lambda: not engine.scheduler.has_work, timeout=10)  # the last writes reported
    finally:
        engine.stop()
        engine.executor.close()
    return engine, seeded


def test_a_restarted_engine_resumes_its_disk_tier_and_another_layout_is_refused(tmp_path):
    """One snapshot slot, so each request's points are evicted to host and written through to disk;
    the catalog written as the engine stops seeds the next one, which a changed page size refuses."""
    directory = tmp_path / "prefix"
    overrides = ["prefix_cache.host_gb=0.01", "prefix_cache.disk_gb=0.02", f"prefix_cache.dir={directory}",
                 "scheduler.prefix_snapshots=1", "scheduler.max_num_seqs=2", "model.max_model_len=256",
                 "scheduler.max_num_batched_tokens=64"]
    prompts = [tuple(range(10 + 50 * i, 50 + 50 * i)) for i in range(2)]
    first, _ = serve(load_config(None, overrides), prompts)
    committed = set(first.scheduler.disk_entries())
    assert committed and set(load_catalog(directory, first.catalog.fingerprint)) == committed
    second, seeded = serve(load_config(None, overrides), prompts[:1])
    assert set(seeded) == committed
    assert second.scheduler.stats().disk_hit_tokens > 0 or second.scheduler.stats().host_hit_tokens > 0
    with pytest.raises(PrefixCatalogError, match=rf"prefix_cache.dir {directory}: .*block_tokens 128 -> 64"):
        build_engine_core(load_config(None, overrides + ["scheduler.block_tokens=64"]), lambda outputs: None)


def test_a_second_server_on_the_directory_is_refused_until_the_first_lets_go(tmp_path):
    """The directory lock: two servers on one prefix_cache.dir would hand out the same records."""
    from engine.prefix_catalog import DirectoryLock, PrefixCatalogError

    first = DirectoryLock(tmp_path)
    with pytest.raises(PrefixCatalogError, match=f"prefix_cache.dir {tmp_path}: another server is using it"):
        DirectoryLock(tmp_path)
    first.release()
    DirectoryLock(tmp_path).release()
