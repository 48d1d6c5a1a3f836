"""Engram rows from table files through io_uring: same logits in every tier, faults fail only the
requests that needed the bad rows, and the reaping path holds up under load."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from contract import EngineLimits, NewRequest, SamplingParams
from engram_store.build import EngramConfigError
from engram_store.convert import read_header, table_file, verify_table, write_table
from engram_store.format import PAGE, TableHeader, check_page
from engram_store.store import EngramOptions
from engram_store.uring import UringPageReader
from models import ForwardBatch, ModelCache, load_model
from scheduler import Scheduler
from tests.conftest import random_tokens
from worker import ModelRunner


def disk_options(path: Path, **overrides) -> EngramOptions:
    return EngramOptions(**{"residency": "disk", "path": path, "host_cache_bytes": 1 << 14, "queue_depth": 8, **overrides})


def logits(model, sequences: list[list[int]]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, len(sequences), 256)
    return model(ForwardBatch.build([(i, s, 0) for i, s in enumerate(sequences)], logits="all"), cache)


def test_every_tier_gives_the_same_logits(checkpoints, tmp_path):
    prompts = [random_tokens(60, seed=1), random_tokens(60, seed=1), random_tokens(45, seed=2)]  # a duplicate
    reference = logits(load_model(checkpoints["v41"], engram=EngramOptions(residency="gpu")), prompts)
    for options in (EngramOptions(residency="host"), disk_options(tmp_path / "tables"),
                    disk_options(tmp_path / "separate", resident_scales=True),
                    EngramOptions(residency="host", layer_residency={4: "disk"}, path=tmp_path / "tables")):
        model = load_model(checkpoints["v41"], engram=options)
        cold = logits(model, prompts)
        warm = logits(model, prompts)
        assert torch.equal(cold, reference) and torch.equal(warm, reference), options
    counters = model.engram_memory.source.counters()  # warm steps' hits are counted on the device, folded here
    assert counters.rows_disk > 0 and counters.rows_host_cache > 0


def test_table_edges_and_duplicates_read_back_exactly(checkpoints, tmp_path):
    memory = load_model(checkpoints["v41"], engram=EngramOptions(residency="host")).engram_memory
    disk = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t")).engram_memory
    for index, rows in enumerate(memory.hasher.layout.num_embeddings):
        ids = torch.tensor([[0, rows - 1, 0, rows - 1], [1, rows - 2, rows // 2, 0]])
        expected = read(memory.source, index, ids)
        step = disk.source.start(dict.fromkeys(range(len(memory.hasher.layout.num_embeddings)), ids))
        assert torch.equal(disk.source.rows(step, index), expected)
    assert verify_table(table_file(tmp_path / "t", 1)) == []


def read(source, layer_index: int, ids: torch.Tensor) -> torch.Tensor:
    """One layer's rows of `ids`, in a step of their own."""
    return source.rows(source.start({layer_index: ids}), layer_index)


def test_disk_on_tmpfs_is_refused(checkpoints):
    if not Path("/dev/shm").exists():
        pytest.skip("no /dev/shm here")
    with pytest.raises(EngramConfigError, match="engram.residency: disk on /dev/shm"):
        load_model(checkpoints["v41"], engram=disk_options(Path("/dev/shm/ds4serve-engram-test")))


def pages_of(model, prompt: list[int], layer_index: int) -> set[int]:
    ids, _ = model.engram_memory.hasher.row_ids(prompt, None, model.engram_memory.hasher.empty_context())
    header = model.engram_memory.source.layers[layer_index].header
    return {int(p) for p in header.page_of(np.unique(ids[:, layer_index]))[0]}


def run_requests(model, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, str]]:
    limits = EngineLimits(4, 512, 256, model.config.vocab_size, (), block_tokens=16)
    runner = ModelRunner(model, 4, 256, num_pages=limits.total_pages, block_tokens=16)
    scheduler = Scheduler(limits)
    for rid, prompt in prompts.items():
        scheduler.add(NewRequest(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    errors: dict[str, str] = {}
    while scheduler.has_work:
        plan = scheduler.schedule()
        for output in scheduler.update(plan, runner.execute(plan)):
            tokens[output.request_id] += output.new_token_ids
            if output.error:
                errors[output.request_id] = output.error
    scheduler.check_integrity()
    return tokens, errors


@pytest.mark.parametrize("fault", ["flipped byte", "truncated", "eio", "foreign page"])
def test_a_bad_page_fails_only_the_requests_that_need_it(checkpoints, tmp_path, fault):
    tables = tmp_path / "tables"
    clean = load_model(checkpoints["v41"], engram=disk_options(tables))
    for seed in range(50):  # "b" short, so that "a" needs some page past all of b's (truncation)
        prompts = {"a": random_tokens(40, seed=5), "b": random_tokens(4, seed=100 + seed)}
        expected, _ = run_requests(clean, prompts)
        fed = {rid: prompts[rid] + expected[rid][:-1] for rid in prompts}  # every token the model will see
        a_pages, b_pages = pages_of(clean, fed["a"], 0), pages_of(clean, fed["b"], 0)
        candidates = sorted(a_pages - b_pages)
        if fault == "truncated":  # cut the file inside a page only "a" needs, keeping all of b's
            candidates = [p for p in candidates if all(q < p for q in b_pages)]
        if candidates:
            break
    assert candidates, "no prompt pair needs a page of its own"
    header = clean.engram_memory.source.layers[0].header
    bad = candidates[-1]
    path = table_file(tables, header.layer_id)
    model = load_model(checkpoints["v41"], engram=disk_options(tables))  # fresh, cold caches
    if fault == "flipped byte":
        with open(path, "r+b") as f:
            f.seek(bad * PAGE + 100)
            byte = f.read(1)
            f.seek(bad * PAGE + 100)
            f.write(bytes([byte[0] ^ 0x40]))
    elif fault == "truncated":
        os.truncate(path, bad * PAGE + 1000)
    elif fault == "eio":
        model.engram_memory.source.tiers["disk"].reader.inject_error = lambda key: 5 if key == (0, bad) else None  # EIO
    else:  # a page of the other layer's file, copied over this one
        other = table_file(tables, model.config.engram.layer_ids[1])
        with open(other, "rb") as src, open(path, "r+b") as dst:
            src.seek(bad * PAGE)
            page = src.read(PAGE)
            dst.seek(bad * PAGE)
            dst.write(page)
    tokens, errors = run_requests(model, prompts)
    assert set(errors) == {"a"} and f"page {bad}" in errors["a"]
    assert tokens["b"] == expected["b"]
    assert model.engram_memory.source.stats.current.read_errors >= 1


def test_reaping_at_queue_depth_64_over_100k_reads(tmp_path):
    """Every byte of 100,000 random page reads at queue depth 64 is checked against the file."""
    rows, dim = 60_000, 256
    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    scales = rng.integers(100, 140, size=(rows, dim // 32), dtype=np.uint8)
    header = TableHeader(table_id=0xABCDEF, layer_id=7, rows=rows, row_dim=dim, value_dtype="float8_e4m3fn",
                         scale_dtype="e8m0", scale_block=32, scale_layout="inline")
    path = tmp_path / "big.tbl"
    write_table(path, header, iter([(values, scales)]))
    header = read_header(path)
    raw = path.read_bytes()
    reader = UringPageReader([path], queue_depth=64)
    checked = 0
    for _ in range(100):  # 100 x 1,000 distinct random pages
        batch = [(0, int(p)) for p in rng.choice(np.arange(1, header.data_pages + 1), 1000, replace=False)]
        pages, failed = reader.read_pages(batch, lambda key, page: check_page(page, key[1], header.table_id))
        assert not failed and pages.shape == (len(batch), PAGE)
        for (_, page_no), data in zip(batch, pages):
            assert data.tobytes() == raw[page_no * PAGE : (page_no + 1) * PAGE]
        checked += len(pages)
    reader.close()
    assert checked == reader.reads == 100_000


def test_store_counters_reach_the_engine_stats_and_metrics(checkpoints, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from server.metrics import engram_figures

    model = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t"))
    limits = EngineLimits(2, 512, 256, model.config.vocab_size, (), block_tokens=16)
    runner = ModelRunner(model, 2, 256, num_pages=limits.total_pages, block_tokens=16)
    scheduler = Scheduler(limits)
    scheduler.add(NewRequest("r", random_tokens(40, seed=9), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    while scheduler.has_work:
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    stats = runner.engram_stats()
    assert stats.rows_disk > 0 and stats.bytes_read > 0 and stats.wait_count >= 8

    class Families:
        def collect(self):
            return list(engram_figures(stats, ["tiny", "0"]))

    registry = CollectorRegistry()
    registry.register(Families())
    text = generate_latest(registry).decode()
    assert f'ds4serve:engram_rows_served_total{{engine="0",model_name="tiny",tier="disk"}} {float(stats.rows_disk)}' in text
    assert f'ds4serve:engram_prefetch_wait_seconds_count{{engine="0",model_name="tiny"}} {float(stats.wait_count)}' in text


def test_hints_warm_the_cache_and_aborted_requests_drop_theirs(checkpoints, tmp_path):
    model = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t", host_cache_bytes=1 << 20))
    memory = model.engram_memory
    store = memory.source
    ids, _ = memory.hasher.row_ids(random_tokens(12, seed=4), None, memory.hasher.empty_context())
    ids = torch.from_numpy(ids)
    disk = store.tiers["disk"]
    store.cancel("gone")
    store.hint(["gone"], dict(enumerate(ids.unbind(1))))
    store.hint(["kept"], dict(enumerate(ids[:6].unbind(1))))
    disk._submit(priority=2, reads={}).result()  # the queue has drained
    kept_pages = sum(len(np.unique(layer.header.page_of(np.unique(ids[:6, k].numpy()))[0]))
                     for k, layer in enumerate(store.layers))
    assert disk.reader.reads == kept_pages  # the aborted request's hint was dropped unread
    layer = store.layers[0]
    assert not layer.host_cache.absent(np.unique(ids[:6, 0].numpy())).any()


def test_a_fully_cached_step_is_gathered_in_one_op_from_the_cache(checkpoints, tmp_path):
    """Once every row of a step is in the host cache, the step's rows come straight from it (one gather
    and decode, no read queued) and equal the resident table's, duplicates and table edges included."""
    memory = load_model(checkpoints["v41"], engram=EngramOptions(residency="host")).engram_memory
    disk = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t")).engram_memory
    store = disk.source
    reader = store.tiers["disk"].reader
    for index, rows in enumerate(memory.hasher.layout.num_embeddings):
        ids = torch.tensor([[0, rows - 1, 0, 5], [rows - 1, 3, 5, 0]])
        expected = read(memory.source, index, ids)
        assert torch.equal(read(store, index, ids), expected)  # cold: read from the file, then cached
        reads, hits = reader.reads, store.counters().rows_host_cache
        assert isinstance(store.start({index: ids}).reads[index], torch.Tensor)  # gathered whole, no read queued
        assert torch.equal(read(store, index, ids), expected)
        assert reader.reads == reads and store.counters().rows_host_cache == hits + 2 * 4  # 4 distinct rows, twice



def _import_uring(results) -> None:
    try:
        import engram_store.uring  # noqa: F401

        results.put("ok")
    except Exception as error:  # the failure is what the test reports
        results.put(repr(error))


def test_liburing_is_imported_by_one_process_at_a_time():
    """liburing's loader deletes and rebuilds a stale cache file beside the package; two TP ranks doing
    it at once failed one of them in CI (FileNotFoundError). While another process holds the import
    lock, a rank's import waits, then succeeds once the lock is released."""
    from engram_store.uring import LIBURING_IMPORT_LOCK

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with open(LIBURING_IMPORT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rank = context.Process(target=_import_uring, args=(results,))
        rank.start()
        with pytest.raises(queue.Empty):
            results.get(timeout=5)
    assert results.get(timeout=60) == "ok"
    rank.join()


def test_the_residency_registry_holds_the_names_the_config_accepts():
    """contract/ cannot import the registry, so its Literal repeats the names: they must stay equal."""
    from typing import get_args

    from contract.config import EngramResidency
    from engram_store.build import RESIDENCIES, check_residencies

    assert set(RESIDENCIES) == set(get_args(EngramResidency))
    with pytest.raises(EngramConfigError, match=r"engram\.layers\.4\.residency: 'nvme' is not one of gpu, host, disk"):
        check_residencies(EngramOptions(layer_residency={4: "nvme"}))


def counting_hashes(hasher, monkeypatch) -> list[int]:
    """Wraps the hasher's two entry points; returns the list every hashed token id is appended to."""
    hashed: list[int] = []
    row_ids, next_row_ids = hasher.row_ids, hasher.next_row_ids

    def counted_row_ids(token_ids, live, context):
        hashed.extend(token_ids)
        return row_ids(token_ids, live, context)

    def counted_next_row_ids(token_ids, contexts):
        hashed.extend(np.asarray(token_ids).tolist())
        return next_row_ids(token_ids, contexts)

    monkeypatch.setattr(hasher, "row_ids", counted_row_ids)
    monkeypatch.setattr(hasher, "next_row_ids", counted_next_row_ids)
    return hashed


def test_a_decode_token_is_hashed_once_with_a_disk_tier(checkpoints, tmp_path, monkeypatch):
    """The runner hints each sampled token (hashing it); the step that feeds it reuses those row ids:
    every prompt token and every sampled token is hashed exactly once, and the tokens are the same."""
    prompts = {"a": random_tokens(40, seed=5), "b": random_tokens(4, seed=6)}
    expected, _ = run_requests(load_model(checkpoints["v41"], engram=EngramOptions(residency="host")), prompts)
    model = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t"))
    hashed = counting_hashes(model.engram_memory.hasher, monkeypatch)
    tokens, errors = run_requests(model, prompts)
    assert tokens == expected and not errors
    assert len(hashed) == sum(map(len, prompts.values())) + sum(map(len, tokens.values()))


def test_the_decode_step_reuses_a_hint_only_for_the_token_and_look_back_it_hashed(checkpoints, tmp_path, monkeypatch):
    model = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t"))
    memory = model.engram_memory
    cache = ModelCache.allocate(model.config, 2, 64)
    model(ForwardBatch.build([(0, random_tokens(9, seed=1), 0), (1, random_tokens(5, seed=2), 0)]), cache)
    context = cache.engram_context
    expected = torch.from_numpy(memory.hasher.next_row_ids(np.array([7, 8]), context.numpy()))
    hashed = counting_hashes(memory.hasher, monkeypatch)
    memory.hint_next(["a", "b"], [0, 1], [7, 11], context)  # b is then fed another token than the hinted one
    assert torch.equal(memory.step_row_ids([0, 1], [7, 8], [9, 5], context), expected)
    assert hashed == [7, 11, 8]


def test_a_steps_failures_belong_to_that_step_whatever_the_call_order(checkpoints, tmp_path):
    memory = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t")).engram_memory
    store = memory.source
    store.tiers["disk"].reader.inject_error = lambda key: 5 if key == (0, 1) else None  # EIO on layer 0's page 1
    far = 3 * store.layers[0].header.rows_per_page  # a row of page 4
    broken = store.start({0: torch.tensor([[0, far], [far, far + 1]])})  # token 0 needs row 0, on page 1
    clean = store.start({0: torch.tensor([[far + 2, far + 3]])})
    assert torch.equal(store.rows(clean, 0), read(store, 0, torch.tensor([[far + 2, far + 3]])))  # the later step first
    store.rows(broken, 0)
    assert clean.failed == {} and list(broken.failed) == [0] and "page 1" in broken.failed[0]
    columns = memory.hasher.layout.n_columns
    step = memory.start(torch.zeros(1, 2, columns, dtype=torch.long))
    [memory.rows(step, layer) for layer in range(2)]
    assert list(memory.failed_tokens()) == [0]
    step = memory.start(torch.full((1, 2, columns), far))
    [memory.rows(step, layer) for layer in range(2)]
    assert memory.failed_tokens() == {}  # the later step's own: none


def test_check_integrity_holds_after_churn_and_catches_a_corrupted_cache_index(checkpoints, tmp_path):
    model = load_model(checkpoints["v41"], engram=disk_options(tmp_path / "t"))  # a host cache of ~250 rows a layer
    run_requests(model, {"a": random_tokens(60, seed=7), "b": random_tokens(30, seed=8), "c": random_tokens(45, seed=9)})
    memory = model.engram_memory
    memory.source.tiers["disk"]._submit(priority=2, reads={}).result()  # every hint read
    cache = memory.source.layers[0].host_cache
    assert cache.misses > cache.capacity == len(cache)  # full, and more rows came in than fit: evictions
    memory.check_integrity()
    rows = list(cache.index)
    cache.index[rows[0]] = cache.index[rows[1]]  # two rows claim one slot: a lookup would serve the wrong bytes
    with pytest.raises(AssertionError, match="a slot another row holds"):
        memory.check_integrity()
