"""The Engram row store: every layer's rows from its residency tier, with disk reads prefetched.

Tiers, chosen per layer (`engram.residency`, per-layer overrides):
- gpu: the whole table in the compute device's memory; host: the whole table in (pinned) RAM;
- disk: the table file (format.py) on NVMe, read through io_uring, with a host row cache (cache.py:
  CLOCK with hit credits) and optionally a device row cache in front of it.
The model calls `prefetch(row ids of the step, every Engram layer)` as soon as it has hashed the step's
tokens: disk layers dedupe the rows, serve cache hits and queue the misses on the I/O thread, so the
reads overlap the layers that run before the first Engram layer. `rows(layer, ids)` then waits only for
that layer. The runner also hands over `hint`s (a sampled token's rows, before its step is scheduled)
that warm the cache and are cancelled if the request is aborted.
A row that cannot be read and verified is never used: it comes back as zeros and the tokens that
needed it are reported by `failed_tokens()`, so the runner fails exactly those requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from contract import PREFETCH_WAIT_BUCKETS, EngramStats
from engram_store.cache import FREE, RowCache
from engram_store.format import PAGE, TableHeader, check_page
from engram_store.uring import PageKey, UringPageReader
from kernels import gather_engram_rows

log = logging.getLogger("ds4serve.engram")
RESIDENCIES = ("gpu", "host", "disk")


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


@dataclass
class StoreStats:
    """Counters since start (served rows per tier, reads) and how long Engram layers waited for rows."""

    rows_resident: int = 0
    rows_device_cache: int = 0
    rows_host_cache: int = 0
    rows_disk: int = 0
    bytes_read: int = 0
    read_errors: int = 0
    wait_count: int = 0
    wait_sum_s: float = 0.0
    wait_buckets: list[int] = field(default_factory=lambda: [0] * len(PREFETCH_WAIT_BUCKETS))  # cumulative
    recent_waits_s: deque = field(default_factory=lambda: deque(maxlen=1 << 16))  # for percentiles (bench)

    def record_wait(self, seconds: float) -> None:
        self.wait_count += 1
        self.wait_sum_s += seconds
        for i, edge in enumerate(PREFETCH_WAIT_BUCKETS):
            if seconds <= edge:
                self.wait_buckets[i] += 1
        self.recent_waits_s.append(seconds)

    def snapshot(self) -> EngramStats:
        return EngramStats(
            rows_resident=self.rows_resident, rows_device_cache=self.rows_device_cache,
            rows_host_cache=self.rows_host_cache, rows_disk=self.rows_disk, bytes_read=self.bytes_read,
            read_errors=self.read_errors, wait_count=self.wait_count, wait_sum_s=self.wait_sum_s,
            wait_buckets=tuple(self.wait_buckets),
        )


class ResidentLayer:
    """gpu / host residency: the whole table in memory."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, device: str) -> None:
        self.values, self.scales, self.device = values, scales, device

    def rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        return gather_engram_rows(self.values, self.scales, row_ids.to(self.values.device)).to(self.device)


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
                setattr(stats, counter, getattr(stats, counter) + int(hit.sum()))
            self._gathered()
        return raw, missing

    def gather_hits(self, ids: np.ndarray, stats: StoreStats) -> torch.Tensor | None:
        """float32 rows [len(ids), row_dim] when one cache holds every row of `ids` (a warm step): their
        slots gathered and decoded on the compute device by one kernel straight from the cache's
        storage, queued under the lock so no eviction overtakes it. None otherwise (or when the scales
        are kept apart, or the table is not fp8 with E8M0 scales): the general path runs."""
        h = self.header
        if self.resident_scales is not None or h.value_dtype != "float8_e4m3fn" or h.scale_dtype != "e8m0":
            return None
        with self.lock:
            for cache, counter in ((self.device_cache, "rows_device_cache"), (self.host_cache, "rows_host_cache")):
                if cache is None:
                    continue
                slots = cache.slots_of(ids)  # repeated rows are looked up again: cheaper than deduping
                if (slots == FREE).any():
                    continue
                hits_before = cache.hits
                cache.credit_hits(slots)
                slot_ids = torch.from_numpy(slots).to(cache.view.device)
                values = cache.view[:, : h.value_bytes].view(torch.float8_e4m3fn)
                rows = gather_engram_rows(values, cache.view[:, h.value_bytes :], slot_ids).to(self.device)
                setattr(stats, counter, getattr(stats, counter) + cache.hits - hits_before)
                self._gathered()
                return rows
        return None

    def _gathered(self) -> None:
        """After this step's gathers from the caches are queued: on a GPU, an event the I/O thread
        waits for before it overwrites a cache slot (the kernels read the slots later than now)."""
        if torch.device(self.device).type == "cuda":
            self.reads_done = torch.cuda.Event()
            self.reads_done.record()

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
        stats.rows_disk += int(loaded.sum())
        if loaded.any():
            with self.lock:
                if self.reads_done is not None:
                    self.reads_done.synchronize()  # no slot a queued gather still reads is overwritten
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


class EngramStore:
    def __init__(self, layers: list[ResidentLayer | DiskLayer], reader: UringPageReader | None, device: str) -> None:
        self.layers, self.reader, self.device = layers, reader, device
        self.stats = StoreStats()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._pending: dict[int, tuple | torch.Tensor] = {}
        self._failed: dict[int, str] = {}
        self._cancelled: set[str] = set()
        self._order = 0
        self._thread = None
        if reader is not None:
            self._thread = threading.Thread(target=self._serve, name="ds4serve-engram-io", daemon=True)
            self._thread.start()

    # -- the model's side ------------------------------------------------------------------------
    def prefetch(self, row_ids: torch.Tensor) -> None:
        """row_ids [T, engram layers, columns] of the step about to run: serves cache hits now and
        starts the disk layers' reads of the rest, every layer's in one job (one queue of reads)."""
        self._failed = {}
        self._pending = self._start({index: row_ids[:, index] for index, layer in enumerate(self.layers)
                                     if isinstance(layer, DiskLayer)})

    def _start(self, row_ids: dict[int, torch.Tensor]) -> dict[int, tuple | torch.Tensor]:
        """What rows() needs for each of these disk layers: the decoded rows already (every row
        cached), or the distinct rows, the cached ones' bytes, the missing mask and the read job."""
        started: dict[int, tuple | torch.Tensor] = {}
        reads: dict[int, np.ndarray] = {}
        for index, ids in row_ids.items():
            ready = self.layers[index].gather_hits(ids.numpy().reshape(-1), self.stats)
            if ready is not None:
                started[index] = ready
                continue
            unique = np.unique(ids.numpy())
            raw, missing = self.layers[index].cached(unique, self.stats)
            started[index] = (unique, raw, missing)
            if missing.any():
                reads[index] = unique[missing]
        future = self._submit(priority=0, reads=reads) if reads else None
        return {index: (*state, future if index in reads else None) if isinstance(state, tuple) else state
                for index, state in started.items()}

    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        """[T, columns, row_dim] float32 rows on the compute device; waits for this layer's reads."""
        layer = self.layers[layer_index]
        if isinstance(layer, ResidentLayer):
            self.stats.rows_resident += row_ids.numel()
            return layer.rows(row_ids)
        ids = row_ids.numpy()
        pending = self._pending.pop(layer_index, None)
        if pending is None:
            pending = self._start({layer_index: row_ids})[layer_index]
        if isinstance(pending, torch.Tensor):  # every row was cached: nothing to wait for
            self.stats.record_wait(0.0)
            return pending.view(*row_ids.shape, -1)
        unique, raw, missing, future = pending
        failed: dict[int, str] = {}
        started = time.perf_counter()
        if future is not None:
            read_raw, failed = future.result()[layer_index]
            raw[torch.from_numpy(missing).to(raw.device)] = read_raw.to(raw.device)
        self.stats.record_wait(time.perf_counter() - started)
        index = torch.from_numpy(np.searchsorted(unique, ids.reshape(-1))).to(raw.device)
        rows = layer.decode(raw[index], torch.from_numpy(ids.reshape(-1)))
        if failed:
            bad = np.isin(ids, np.fromiter(failed, dtype=np.int64))
            rows[torch.from_numpy(bad.reshape(-1)).to(rows.device)] = 0.0  # never a wrong row: zeros, and the token fails
            for token in np.flatnonzero(bad.any(axis=1)).tolist():
                first = next(int(r) for r in ids[token] if int(r) in failed)
                self._failed.setdefault(token, failed[first])
        return rows.view(*row_ids.shape, -1).to(self.device)

    def failed_tokens(self) -> dict[int, str]:
        """Tokens of the last step (flat batch rows) whose rows could not be served, with the reason."""
        return dict(self._failed)

    def resident_bytes(self) -> int:
        tensors = []
        for layer in self.layers:
            if isinstance(layer, ResidentLayer):
                tensors += [layer.values, layer.scales]
            else:
                tensors += [c.storage for c in (layer.host_cache, layer.device_cache) if c is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def reads_disk(self) -> bool:
        """Whether some layer reads from disk (only then are hints worth hashing)."""
        return self.reader is not None

    # -- the scheduler's side --------------------------------------------------------------------
    def hint(self, request_ids: list[str], row_ids: torch.Tensor) -> None:
        """Warms the host cache for rows that requests will need next (row_ids [T, L, C]); skipped if
        every one of `request_ids` was aborted before the I/O thread gets to it."""
        reads = {index: np.unique(row_ids[:, index].numpy()) for index, layer in enumerate(self.layers)
                 if isinstance(layer, DiskLayer)}
        if reads:
            self._submit(priority=1, reads=reads, request_ids=tuple(request_ids))

    def cancel(self, request_id: str) -> None:
        """Drops the request's hints that have not been read yet."""
        self._cancelled.add(request_id)

    # -- the I/O thread --------------------------------------------------------------------------
    def _submit(self, priority: int, reads: dict[int, np.ndarray], request_ids: tuple[str, ...] = ()) -> Future:
        """Queues one read job: distinct rows per disk layer. Its future gives, per layer, the rows'
        bytes and why each unusable row failed."""
        future: Future = Future()
        if self._thread is None:
            raise RuntimeError("disk-resident Engram layers need the I/O thread")
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
        self.stats.bytes_read, self.stats.read_errors = self.reader.bytes_read, self.reader.errors
        result, start = {}, 0
        for index, rows in reads.items():
            end = start + len(keys_of[index])
            layer_bad = {position - start: why for position, why in bad.items() if start <= position < end}
            result[index] = layers[index].take(rows, pages[start:end], layer_bad, self.stats)
            start = end
        return result

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put((-1, 0, None, (), None))
            self._thread.join(5)
            self._thread = None
        if self.reader is not None:
            self.reader.close()
