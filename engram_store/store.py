"""The Engram row store: every layer's rows from its residency's tier, with disk reads prefetched.

Tiers, one per residency in use (`engram.residency`, per-layer overrides; build.py's RESIDENCIES opens
them), all behind `EngramTier`:
- gpu: the whole table in the compute device's memory; host: the whole table in (pinned) RAM;
- disk: the table file (format.py) on NVMe, read through io_uring, with a host row cache (cache.py:
  CLOCK with hit credits) and optionally a device row cache in front of it.
The model calls `start(row ids of the step, every Engram layer)` as soon as it has hashed the step's
tokens and gets an `EngramStep`: disk layers dedupe the rows, serve cache hits and queue the misses on
the I/O thread, so the reads overlap the layers that run before the first Engram layer.
`rows(step, layer)` then waits only for that layer. The runner also hands over `hint`s (a sampled
token's rows, before its step is scheduled) that warm the cache and are cancelled if the request is
aborted. A row that cannot be read and verified is never used: it comes back as zeros and the tokens
that needed it are in the step's `failed`, so the runner fails exactly those requests; the failed
reads are also logged (ReadFailureLog: one line per read job at most every few seconds, so a failing
disk cannot flood the log).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from contract import PREFETCH_WAIT_BUCKETS, EngramStats
from engram_store.cache import FREE, RowCache
from engram_store.format import PAGE, TableHeader, check_page
from engram_store.rows import EngramStep
from engram_store.uring import PageKey, UringPageReader
from kernels import gather_engram_rows

log = logging.getLogger("ds4serve.engram")


@dataclass(frozen=True)
class EngramOptions:
    """engram: section of the YAML, resolved (see contract/config.py)."""

    residency: str = "host"
    layer_residency: dict[int, str] = field(default_factory=dict)  # per-layer overrides
    path: Path | None = None  # table files; default MODEL_DIR/engram, converted on first use
    host_cache_bytes: int = 4 << 30
    gpu_cache_bytes: int = 0
    queue_depth: int = 64
    resident_scales: bool = False

    def residency_of(self, layer_id: int) -> str:
        return self.layer_residency.get(layer_id, self.residency)

    def residencies(self) -> set[str]:
        """Every residency the options name (the default one even if every layer overrides it)."""
        return {self.residency, *self.layer_residency.values()}


class StoreStats:
    """The store's counters as one contract.EngramStats (frozen: each count replaces it, under a lock,
    since the model's thread and the I/O thread both count), plus the recent waits a bench reads."""

    def __init__(self) -> None:
        self.current = EngramStats()
        self.recent_waits_s: deque[float] = deque(maxlen=1 << 16)  # for percentiles (bench)
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        """Adds to the named counters (EngramStats' field names)."""
        with self._lock:
            now = self.current
            self.current = replace(now, **{name: getattr(now, name) + n for name, n in counts.items()})

    def set_reads(self, bytes_read: int, read_errors: int) -> None:
        """The reader's own totals, since start."""
        with self._lock:
            self.current = replace(self.current, bytes_read=bytes_read, read_errors=read_errors)

    def record_wait(self, seconds: float) -> None:
        with self._lock:
            now = self.current
            buckets = tuple(count + (seconds <= edge) for count, edge in zip(now.wait_buckets, PREFETCH_WAIT_BUCKETS))
            self.current = replace(now, wait_count=now.wait_count + 1, wait_sum_s=now.wait_sum_s + seconds,
                                   wait_buckets=buckets)
        self.recent_waits_s.append(seconds)

    def snapshot(self) -> EngramStats:
        return self.current


class ReadFailureLog:
    """Warnings for page reads that failed (after the reader's retry), naming file, page and reason.

    A read job (a step's misses, or a hint) logs one line: its first failed page and how many pages
    failed with it. A failing disk fails many pages per step at many steps a second, so a line is
    written at most every `every_s` seconds; the failures in between are counted, and the next line
    says how many went unlogged. The counters (`read_errors`) still count every one."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last = -float("inf")
        self._unlogged = 0  # failed pages since the last line, not named in any

    def record(self, failures: Sequence[tuple[Path, int, str]]) -> None:
        """One job's failures: (file, page number, reason) each. Called by the I/O thread only."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._unlogged += len(failures)
            return
        path, page, why = failures[0]
        others = f"; {len(failures) - 1} more pages failed in this read" if len(failures) > 1 else ""
        unlogged = f"; {self._unlogged} failed page reads not logged since the last warning" if self._unlogged else ""
        log.warning("Engram read failed: %s page %d: %s%s%s", path, page, why, others, unlogged)
        self._last, self._unlogged = now, 0


class ResidentLayer:
    """gpu / host residency: the whole table in memory."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, device: str) -> None:
        self.values, self.scales, self.device = values, scales, device

    def rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        return gather_engram_rows(self.values, self.scales, row_ids.to(self.values.device)).to(self.device)

    def check_integrity(self) -> None:
        v, s = self.values, self.scales
        assert v.shape[0] == s.shape[0] and v.shape[1] % s.shape[1] == 0, (tuple(v.shape), tuple(s.shape))


class DiskLayer:
    """disk residency: a table file, a host row cache and an optional device row cache."""

    def __init__(self, header: TableHeader, file_index: int, host_cache: RowCache, device_cache: RowCache | None,
                 resident_scales: torch.Tensor | None, device: str) -> None:
        self.header, self.file_index, self.device = header, file_index, device
        self.host_cache, self.device_cache = host_cache, device_cache
        self.lock = threading.Lock()  # the caches are shared by the model's thread and the I/O thread
        self.resident_scales = resident_scales  # [rows, scale bytes] when the file keeps scales apart
        self.reads_done: torch.cuda.Event | None = None  # the last step's cache gathers (see _gathered)

    def cached(self, rows: np.ndarray, stats: StoreStats) -> tuple[torch.Tensor, np.ndarray]:
        """Raw bytes [len(rows), row_bytes] on the compute device of the distinct `rows` the caches hold
        (gathered there from each cache's storage), and the mask of the ones they do not. Cheap: the
        model's thread calls it, so cache hits never wait on the I/O thread."""
        raw = torch.zeros(len(rows), self.header.row_bytes, dtype=torch.uint8, device=self.device)
        missing = np.ones(len(rows), dtype=bool)
        with self.lock:
            for cache, counter in ((self.device_cache, "rows_device_cache"), (self.host_cache, "rows_host_cache")):
                if cache is None or not missing.any():
                    continue
                wanted = np.flatnonzero(missing)
                hit, slots = cache.lookup(rows[wanted])
                if hit.any():
                    target = torch.from_numpy(wanted[hit]).to(self.device)
                    raw[target] = cache.view[torch.from_numpy(slots).to(cache.view.device)].to(self.device)
                missing[wanted[hit]] = False
                stats.add(**{counter: int(hit.sum())})
            self._gathered()
        return raw, missing

    @property
    def gathers_warm(self) -> bool:
        """Whether a step's rows can be gathered and decoded by the one kernel straight from a cache's
        storage: fp8 values with E8M0 scales beside them in the row."""
        h = self.header
        return self.resident_scales is None and h.value_dtype == "float8_e4m3fn" and h.scale_dtype == "e8m0"

    def caches(self) -> list[tuple[RowCache, str]]:
        """The caches a step tries, fastest first, with the counter their hits count in."""
        pairs = ((self.device_cache, "rows_device_cache"), (self.host_cache, "rows_host_cache"))
        return [(cache, counter) for cache, counter in pairs if cache is not None]

    def device_slots(self, ids: torch.Tensor, misses: torch.Tensor, first: int) -> list[torch.Tensor]:
        """Each cache's slots of `ids` (FREE where it lacks the row), looked up in its device index by a
        fixed number of ops, the i-th cache's misses counted in misses[first + i]; under the lock, like
        the gather that follows."""
        return [cache.device_slots_of(ids.to(cache.view.device, non_blocking=True), misses, first + i)
                for i, (cache, _) in enumerate(self.caches())]

    def gather_slots(self, which: int, slots: torch.Tensor) -> torch.Tensor:
        """float32 rows [slots.numel(), row_dim] on the compute device: the `which`-th cache's `slots`
        (all held) gathered and decoded by one kernel from its storage (mapped host memory for the host
        cache), their hits counted on the device. Queued under the lock, with the event the I/O
        thread waits for before it overwrites a slot."""
        h = self.header
        cache, _ = self.caches()[which]
        values = cache.view[:, : h.value_bytes].view(torch.float8_e4m3fn)
        rows = gather_engram_rows(values, cache.view[:, h.value_bytes :], slots.reshape(-1)).to(self.device)
        cache.count_hits_on_device(slots)
        self._gathered()
        return rows

    def fold_hits(self, stats: StoreStats) -> None:
        """Adds the caches' device-counted hits to their credits and to `stats`, once the steps that
        counted them are done (the caller holds the lock)."""
        if self.reads_done is not None:
            self.reads_done.synchronize()
        for cache, counter in self.caches():
            stats.add(**{counter: cache.fold_hits()})

    def _gathered(self) -> None:
        """After this step's gathers from the caches are queued: on a GPU, an event the I/O thread
        waits for before it overwrites a cache slot (the kernels read the slots later than now)."""
        if torch.device(self.device).type == "cuda":
            self.reads_done = torch.cuda.Event()
            self.reads_done.record()

    def check_integrity(self) -> None:
        """Each cache's bookkeeping agrees with itself (cache.py), holds rows of this table only, and
        stores rows of this table's width."""
        with self.lock:
            for cache in (self.host_cache, self.device_cache):
                if cache is None:
                    continue
                cache.check_integrity()
                held = cache.row_of_slot[cache.row_of_slot != FREE]
                assert ((0 <= held) & (held < self.header.rows)).all(), f"layer {self.header.layer_id}: a cached row outside the table"
                assert cache.storage.shape == (cache.capacity, self.header.row_bytes), "cache storage of another row width"

    def page_keys(self, rows: np.ndarray) -> list[PageKey]:
        """The distinct pages of the file that hold `rows`, in page order (the order `take` expects)."""
        return [(self.file_index, int(page)) for page in np.unique(self.header.page_of(rows)[0])]

    def take(self, rows: np.ndarray, pages: np.ndarray, bad: dict[int, str], stats: StoreStats) -> tuple[torch.Tensor, dict[int, str]]:
        """Cuts distinct `rows` out of their pages (`pages` [len(page_keys(rows)), PAGE], in that order;
        `bad`: why each failed page, by position, failed) with one gather, caches the good ones, and
        says why each row of a failed page is unusable; those rows come back as zeros (so is the page)."""
        h = self.header
        page_numbers, offsets = h.page_of(rows)
        _, page_index = np.unique(page_numbers, return_inverse=True)
        page_index = page_index.reshape(-1)
        raw = torch.from_numpy(pages.reshape(-1)[(page_index * PAGE + offsets)[:, None] + np.arange(h.row_bytes)])
        page_ok = np.ones(len(pages), dtype=bool)
        page_ok[list(bad)] = False
        loaded = page_ok[page_index]
        failed = {int(row): f"Engram layer {h.layer_id} row {int(row)} (page {int(page)}): {bad[int(index)]}"
                  for row, page, index in zip(rows[~loaded], page_numbers[~loaded], page_index[~loaded])}
        stats.add(rows_disk=int(loaded.sum()))
        if loaded.any():
            with self.lock:
                self.fold_hits(stats)  # also waits for the queued gathers: no slot one still reads is overwritten
                good = torch.from_numpy(loaded)
                self.host_cache.insert(rows[loaded], raw[good])
                if self.device_cache is not None:
                    self.device_cache.insert(rows[loaded], raw[good])
        return raw, failed

    def decode(self, raw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Row bytes -> float32 rows [n, row_dim] (values times their block scales)."""
        h = self.header
        values = raw[:, : h.value_bytes].contiguous()
        values = values.view({"float8_e4m3fn": torch.float8_e4m3fn, "bfloat16": torch.bfloat16,
                              "float32": torch.float32}[h.value_dtype]).float()
        scale_bytes = raw[:, h.value_bytes :] if self.resident_scales is None else self.resident_scales[rows].to(raw.device)
        if h.scale_dtype == "e8m0":
            scales = torch.exp2(scale_bytes.float() - 127)
        else:
            scales = scale_bytes.contiguous().view(torch.float32)
        return (values.view(len(raw), -1, h.scale_block) * scales[..., None]).view(len(raw), h.row_dim)


class EngramTier(Protocol):
    """One residency's layers (build.py's RESIDENCIES opens one tier per residency in use). Layer
    indexes are positions among the model's Engram layers; the store routes each to its tier."""

    layers: Mapping[int, ResidentLayer | DiskLayer]
    stats: StoreStats  # the store's counters, shared by its tiers

    def start(self, step: EngramStep) -> None:
        """Begins reading the step's ids of this tier's layers, keeping what it started in `step.reads`."""
        ...

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        """[*ids.shape, row_dim] float32 rows of one of this tier's layers, on the compute device."""
        ...

    def hint(self, request_ids: tuple[str, ...], row_ids: Mapping[int, torch.Tensor]) -> None:
        """Reads ahead the rows of this tier's layers that `request_ids` will need next."""
        ...

    def cancel(self, request_id: str) -> None:
        ...

    @property
    def reads_ahead(self) -> bool:
        ...

    def resident_bytes(self) -> int:
        ...

    def count_hits(self) -> None:
        """Brings `stats` up to date with hits counted on the device (read before the counters)."""
        ...

    def check_integrity(self) -> None:
        ...

    def close(self) -> None:
        ...


class ResidentTier:
    """gpu / host residency: whole tables in memory, so a step has nothing to start or wait for."""

    reads_ahead = False

    def __init__(self, layers: dict[int, ResidentLayer], stats: StoreStats) -> None:
        self.layers, self.stats = layers, stats

    def start(self, step: EngramStep) -> None:
        """Every row is resident."""

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        ids = step.row_ids[layer_index]
        self.stats.add(rows_resident=ids.numel())
        return self.layers[layer_index].rows(ids)

    def hint(self, request_ids: tuple[str, ...], row_ids: Mapping[int, torch.Tensor]) -> None:
        """Nothing to read ahead."""

    def cancel(self, request_id: str) -> None:
        """No hints to drop."""

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.values, layer.scales))

    def count_hits(self) -> None:
        """Counted as served."""

    def check_integrity(self) -> None:
        for layer in self.layers.values():
            layer.check_integrity()

    def close(self) -> None:
        """Nothing runs."""


@dataclass
class DiskRead:
    """A disk layer's part of a step whose rows were not all cached: its row ids on the host, its distinct
    rows, their bytes (the cached ones so far), the mask of the missing ones and the job reading them
    (None once its result is merged, or when nothing was missing), and why each unreadable row failed."""

    ids: np.ndarray
    unique: np.ndarray
    raw: torch.Tensor
    missing: np.ndarray
    job: Future | None = None
    failed: dict[int, str] = field(default_factory=dict)

    def wait(self, layer_index: int) -> None:
        """Merges the read job's bytes into `raw` (once: rows() may be asked again for the layer)."""
        if self.job is None:
            return
        read_raw, self.failed = self.job.result()[layer_index]
        self.raw[torch.from_numpy(self.missing).to(self.raw.device)] = read_raw.to(self.raw.device)
        self.job = None


class DiskTier:
    """disk residency: the layers' table files read by one I/O thread, through their row caches."""

    reads_ahead = True

    def __init__(self, layers: dict[int, DiskLayer], reader: UringPageReader, stats: StoreStats) -> None:
        self.layers, self.reader, self.stats = layers, reader, stats
        self.failure_log = ReadFailureLog()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._cancelled: set[str] = set()
        self._order = 0
        self._thread: threading.Thread | None = threading.Thread(target=self._serve, name="ds4serve-engram-io", daemon=True)
        self._thread.start()
        # a daemon thread still inside a torch op while the interpreter tears torch down aborts the
        # process ("terminate called without an active exception", seen in a TP rank): stop it first
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- the model's side ------------------------------------------------------------------------
    def start(self, step: EngramStep) -> None:
        """Per layer: the decoded rows already (one cache holds every row: looked up and gathered on the
        device, `_gather_warm`), or the distinct rows with the cached ones' bytes; the misses of every
        layer queued as one read job."""
        mine = {index: ids for index, ids in step.row_ids.items() if index in self.layers}
        step.reads.update(self._gather_warm(mine))
        reads: dict[int, np.ndarray] = {}
        for index, ids in mine.items():
            if index in step.reads:
                continue
            host_ids = ids.cpu().numpy()
            unique = np.unique(host_ids)
            raw, missing = self.layers[index].cached(unique, self.stats)
            step.reads[index] = DiskRead(host_ids, unique, raw, missing)
            if missing.any():
                reads[index] = unique[missing]
        if reads:
            job = self._submit(priority=0, reads=reads)
            for index in reads:
                step.reads[index].job = job

    def _gather_warm(self, row_ids: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The decoded rows [ids.numel(), row_dim] of each layer one of whose caches holds every row of
        its `row_ids`: slots looked up in the caches' device indexes, rows gathered from the cache's
        storage by one kernel, hits counted on the device. The host reads one miss count per layer
        and cache (one small copy for the whole step) and never a row id, so a warm step's host work
        does not grow with its rows. Layers with a miss are left to the host path."""
        layers = {index: self.layers[index] for index in row_ids if self.layers[index].gathers_warm}
        if not layers:
            return {}
        firsts = list(itertools.accumulate((len(layer.caches()) for layer in layers.values()), initial=0))
        device = next(iter(layers.values())).caches()[0][0].view.device  # where the lookups run
        misses = torch.zeros(firsts[-1], dtype=torch.int32, device=device)
        with ExitStack() as held:
            for layer in layers.values():  # the I/O thread holds one layer's lock at a time: no deadlock
                held.enter_context(layer.lock)
            slots = {index: layer.device_slots(row_ids[index], misses, first)
                     for (index, layer), first in zip(layers.items(), firsts)}
            counts = misses.tolist()  # the step's one read
            ready = {}
            for index, layer in layers.items():
                layer_misses, counts = counts[: len(slots[index])], counts[len(slots[index]) :]
                if 0 in layer_misses:
                    which = layer_misses.index(0)
                    ready[index] = layer.gather_slots(which, slots[index][which])
            return ready

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        """Waits for this layer's part of the step's read job only; unreadable rows are zeros and
        their tokens fail in `step`."""
        read = step.reads[layer_index]
        if isinstance(read, torch.Tensor):  # every row was cached: nothing to wait for
            self.stats.record_wait(0.0)
            return read.view(*step.row_ids[layer_index].shape, -1)
        ids = read.ids
        started = time.perf_counter()
        read.wait(layer_index)
        self.stats.record_wait(time.perf_counter() - started)
        index = torch.from_numpy(np.searchsorted(read.unique, ids.reshape(-1))).to(read.raw.device)
        rows = self.layers[layer_index].decode(read.raw[index], torch.from_numpy(ids.reshape(-1)))
        if read.failed:
            self._fail(step, ids, read.failed, rows)
        return rows.view(*ids.shape, -1).to(self.layers[layer_index].device)

    @staticmethod
    def _fail(step: EngramStep, ids: np.ndarray, failed: dict[int, str], rows: torch.Tensor) -> None:
        """Zeros for the rows that failed (never a wrong row) and, for each token that needed one, the
        first failed row's reason in the step."""
        bad = np.isin(ids, np.fromiter(failed, dtype=np.int64))
        rows[torch.from_numpy(bad.reshape(-1)).to(rows.device)] = 0.0
        for token in np.flatnonzero(bad.any(axis=1)).tolist():
            step.fail(token, failed[next(int(r) for r in ids[token] if int(r) in failed)])

    def resident_bytes(self) -> int:
        """The caches' storage and their device bookkeeping (index, credits, stamps: ~80 MB of device
        memory for a 10% host cache of a 4.6 GB table)."""
        caches = [c for layer in self.layers.values() for c, _ in layer.caches()]
        return sum(c.storage.numel() * c.storage.element_size() + c.device_bytes for c in caches)

    def count_hits(self) -> None:
        """Folds the hits warm steps counted on the device into the caches and the counters."""
        for layer in self.layers.values():
            with layer.lock:
                layer.fold_hits(self.stats)

    def check_integrity(self) -> None:
        files = [layer.file_index for layer in self.layers.values()]
        assert sorted(files) == list(range(len(self.reader.fds))), "layers and table files do not pair up"
        for layer in self.layers.values():
            layer.check_integrity()

    # -- the scheduler's side --------------------------------------------------------------------
    def hint(self, request_ids: tuple[str, ...], row_ids: Mapping[int, torch.Tensor]) -> None:
        """Warms the host caches for rows that requests will need next; skipped if every one of
        `request_ids` was aborted before the I/O thread gets to it."""
        reads = {index: np.unique(ids.numpy()) for index, ids in row_ids.items() if index in self.layers}
        if reads:
            self._submit(priority=1, reads=reads, request_ids=request_ids)

    def cancel(self, request_id: str) -> None:
        """Drops the request's hints that have not been read yet."""
        self._cancelled.add(request_id)

    # -- the I/O thread --------------------------------------------------------------------------
    def _submit(self, priority: int, reads: dict[int, np.ndarray], request_ids: tuple[str, ...] = ()) -> Future:
        """Queues one read job: distinct rows per disk layer. Its future gives, per layer, the rows'
        bytes and why each unusable row failed."""
        future: Future = Future()
        if self._thread is None:
            raise RuntimeError("the Engram I/O thread was stopped (store closed)")
        self._order += 1
        self._jobs.put((priority, self._order, reads, request_ids, future))
        return future

    def _serve(self) -> None:
        while True:
            priority, _, reads, request_ids, future = self._jobs.get()
            if reads is None:
                return
            if request_ids and all(r in self._cancelled for r in request_ids):
                future.cancel()
                continue
            if self._jobs.empty():
                self._cancelled.clear()  # every hint queued before those aborts has been seen
            try:
                if request_ids:  # a hint: only what the host caches lack
                    reads = self._absent(reads)
                future.set_result(self._read(reads) if reads else {})
            except Exception as exc:  # a failure here must not kill the thread the model waits on
                log.exception("Engram fetch failed")
                future.set_result({
                    index: (torch.zeros(len(rows), self.layers[index].header.row_bytes, dtype=torch.uint8),
                            {int(r): f"Engram layer {index}: {type(exc).__name__}: {exc}" for r in rows.tolist()})
                    for index, rows in reads.items()})

    def _absent(self, reads: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The rows of `reads` that the layers' host caches lack (layers with none left out)."""
        absent = {}
        for index, rows in reads.items():
            layer = self.layers[index]
            with layer.lock:
                rows = rows[layer.host_cache.absent(rows)]
            if len(rows):
                absent[index] = rows
        return absent

    def _read(self, reads: dict[int, np.ndarray]) -> dict[int, tuple[torch.Tensor, dict[int, str]]]:
        """Every layer's pages in one read_pages call (so all of them are in flight together), then
        each layer's rows cut out and cached."""
        layers = {index: self.layers[index] for index in reads}
        table_of_file = {layer.file_index: layer.header.table_id for layer in layers.values()}
        keys_of = {index: layers[index].page_keys(rows) for index, rows in reads.items()}
        keys = [key for layer_keys in keys_of.values() for key in layer_keys]
        pages, bad = self.reader.read_pages(keys, lambda key, page: check_page(page, key[1], table_of_file[key[0]]))
        self.stats.set_reads(self.reader.bytes_read, self.reader.errors)
        if bad:
            self.failure_log.record([(self.reader.paths[keys[p][0]], keys[p][1], why) for p, why in sorted(bad.items())])
        result, start = {}, 0
        for index, rows in reads.items():
            end = start + len(keys_of[index])
            layer_bad = {position - start: why for position, why in bad.items() if start <= position < end}
            result[index] = layers[index].take(rows, pages[start:end], layer_bad, self.stats)
            start = end
        return result

    def close(self) -> None:
        """Stops the I/O thread and closes the reader; safe to call twice (and again at exit)."""
        if self._thread is None:
            return
        self._jobs.put((-1, 0, None, (), None))
        self._thread.join(5)
        self._thread = None
        self.reader.close()


def _close_at_exit(tier: weakref.ref[DiskTier]) -> None:
    alive = tier()
    if alive is not None:
        alive.close()


class EngramStore:
    """Every Engram layer's rows, each from its residency's tier (a RowSource, rows.py)."""

    def __init__(self, tiers: dict[str, EngramTier], stats: StoreStats) -> None:
        """`tiers`: by residency name, the ones some layer uses; together they hold every layer."""
        self.tiers, self.stats = tiers, stats
        self._tier_of = {index: tier for tier in tiers.values() for index in tier.layers}
        assert sorted(self._tier_of) == list(range(len(self._tier_of))), "a layer index in no tier, or in two"
        self.layers = [self._tier_of[index].layers[index] for index in range(len(self._tier_of))]

    def start(self, row_ids: Mapping[int, torch.Tensor]) -> EngramStep:
        """A step's reads (layer index -> [T, columns] ids), every tier's begun: cache hits served now,
        the disk layers' misses queued as one read job."""
        step = EngramStep(dict(row_ids))
        for tier in self.tiers.values():
            tier.start(step)
        return step

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        """[T, columns, row_dim] float32 rows on the compute device; waits for this layer's reads."""
        return self._tier_of[layer_index].rows(step, layer_index)

    def hint(self, request_ids: Sequence[str], row_ids: Mapping[int, torch.Tensor]) -> None:
        for tier in self.tiers.values():
            tier.hint(tuple(request_ids), row_ids)

    def cancel(self, request_id: str) -> None:
        for tier in self.tiers.values():
            tier.cancel(request_id)

    @property
    def reads_ahead(self) -> bool:
        return any(tier.reads_ahead for tier in self.tiers.values())

    def counters(self) -> EngramStats:
        for tier in self.tiers.values():
            tier.count_hits()
        return self.stats.snapshot()

    def resident_bytes(self) -> int:
        return sum(tier.resident_bytes() for tier in self.tiers.values())

    def check_integrity(self) -> None:
        for tier in self.tiers.values():
            tier.check_integrity()

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
