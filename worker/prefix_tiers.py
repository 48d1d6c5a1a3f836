"""The prefix cache's host and disk tiers on the worker's side (docs/prefix-tiers.md): the bytes, and the
copies the scheduler's TierMoves ask for. The scheduler decides every move; nothing here chooses a row.

Host tier (`HostTier`): for every cache tensor a state point needs, host rows that mirror its rows byte
for byte: `cache.fixed_tensors()` and, when the runner keeps them, its `last_logits` ([slots, vocab]
float32) have `host_slots` rows, `cache.paged_tensors()` have `host_pages`. They live in one host
mapping (kernels/host_memory.py), on CUDA pinned *and* mapped into the GPU's address space, so a spill
or a load is one indexed copy kernel per tensor on the current stream, straight between the cache and
host memory: no staging buffer, no host synchronisation, ordered with the forward like any other
kernel (a GPU slot or page a spill reads may be written by the same step; a load's source rows are
read when the kernel runs). Rows are copied as raw bytes (viewed as the widest word a row divides
into), so the copies are bitwise whatever the dtype. Off CUDA the rows are plain host memory.

Disk tier (`DiskTier`): `<prefix_cache.dir>/rank<r>/slots.bin` (disk_slots records) and `pages.bin`
(disk_pages records), preallocated (`posix_fallocate`: a file kept from an earlier run keeps its
records; the engine's catalog says which are valid). The record layout:

    slot record    each slot row's bytes of cache.fixed_tensors() in their order, then last_logits'
                   (when kept), concatenated: `slot_record_bytes` bytes
    page record    each page row's bytes of cache.paged_tensors() in their order: `page_record_bytes`
    on disk        a record of n bytes takes P = disk_record_pages(n) 4 KiB pages, records back to back
                   (record r is file pages r*P .. r*P + P - 1); page j carries bytes [j*4080, (j+1)*4080)
                   of the record (the last one zero padded) and engram_store's trailer: its page number
                   in the file, the move's seal for this record, crc32 (seal_page / check_page)

Writes are O_DIRECT from an aligned buffer (the host tier is the cache of these bytes; the page cache
would hold them twice), without fdatasync per record: a record that did not reach the disk before a
crash fails verification on its next fetch (stale seal, zero page or checksum), so the request
recomputes rather than resumes wrong state; close() fdatasyncs both files, so after a clean shutdown
every record whose write was reported is durable. Fetches read every page through io_uring with
O_DIRECT (engram_store/uring.py) and check each one's number, seal and checksum; the host rows are
written only if every page of the move verified.

Threads and ordering: one writer and one reader thread per disk tier, each taking its moves in plan
order from a queue; completions (TierDone) go to a thread-safe queue the runner drains each step. On
CUDA every write and fetch carries an event recorded on the compute stream after the plan's spills:
the writer synchronises it before reading host rows (the spills of this plan and earlier ones have
landed), the reader before writing host rows (no load queued earlier still reads rows this fetch
fills). With tensor parallelism each rank has its own tiers; `Tickets` reports a move only once every
rank finished it.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from contract import TierDone, TierMove
from engram_store.format import PAGE, TRAILER, check_page, seal_page
from engram_store.uring import UringPageReader
from kernels.host_memory import mapped_host_bytes
from models import ModelCache, TensorParallel

log = logging.getLogger("ds4serve.worker")

PAYLOAD = PAGE - TRAILER.size  # record bytes a 4 KiB disk page carries
ALIGN = 64  # each mirror's rows start at this alignment in the host mapping (any word view fits)
WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # the widest one that divides a row moves it
MAX_FILE_PAGES = 1 << 32  # the trailer's page number is a u32


def slot_record_bytes(cache: ModelCache, vocab_size: int | None) -> int:
    """Host (and disk record) bytes of one state point's fixed state; `vocab_size` when the runner keeps
    last logits (a float32 row of them is part of the point)."""
    return sum(_row_bytes(t) for t in cache.fixed_tensors()) + (4 * vocab_size if vocab_size else 0)


def page_record_bytes(cache: ModelCache) -> int:
    """Host (and disk record) bytes of one page: a page row of every paged tensor (KV host tier included)."""
    return sum(_row_bytes(t) for t in cache.paged_tensors())


def disk_record_pages(nbytes: int) -> int:
    """4 KiB disk pages a record of `nbytes` takes (each carries PAYLOAD bytes and a trailer)."""
    return -(-nbytes // PAYLOAD)


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a [rows, row bytes] uint8 view (never a copy: copies through it must land in it)."""
    if not tensor.is_contiguous():
        raise ValueError(f"a cache tensor of shape {tuple(tensor.shape)} is not contiguous: its rows cannot be mirrored")
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)


def _word_view(*rows: torch.Tensor) -> list[torch.Tensor]:
    """The same [n, row bytes] uint8 matrices viewed as the widest word that divides the row and every
    one's address: an indexed copy then moves 8 bytes a thread (over PCIe: far fewer, wider requests)."""
    for word in WORDS:
        size = word.itemsize
        if all(r.shape[1] % size == 0 and r.data_ptr() % size == 0 for r in rows):
            return [r.view(word) for r in rows]
    raise AssertionError("uint8 divides every row")


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on `device`; on CUDA from pinned memory without waiting for the stream (the
    caching host allocator keeps the pinned block until the copy has run)."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Mirror:
    """One cache tensor and its host rows. `cache` and `mirror` are the compute device's views (as words)
    that the GPU copies use; `host` is the same host rows as the CPU sees them (uint8 [n, row bytes]),
    which the disk threads read and write."""

    cache: torch.Tensor
    mirror: torch.Tensor
    host: torch.Tensor

    @property
    def row_bytes(self) -> int:
        return self.host.shape[1]


def _check_pairs(kind: str, what: str, pairs: Sequence[tuple[int, int]], sources: int, targets: int) -> None:
    """A move's (source, target) rows must exist on both sides: an index past the end would be a device
    assert on CUDA, or a write past a preallocated file."""
    for source, target in pairs:
        if not (0 <= source < sources and 0 <= target < targets):
            raise ValueError(f"a {kind} move copies {what} {source} -> {target}; the tiers hold {sources} and {targets}")


class HostTier:
    """Host rows mirroring the cache (see the module docstring); spill and load are the GPU <-> host moves."""

    def __init__(self, cache: ModelCache, last_logits: torch.Tensor | None, slots: int, pages: int) -> None:
        """`last_logits`: the runner's kept logits ([slots, vocab] float32), None when it keeps none."""
        fixed = cache.fixed_tensors() + ([last_logits] if last_logits is not None else [])
        tensors = [(t, slots) for t in fixed] + [(t, pages) for t in cache.paged_tensors()]
        offsets, total = [], 0
        for tensor, rows in tensors:
            offsets.append(total)
            total += -(-rows * _row_bytes(tensor) // ALIGN) * ALIGN
        self.device = fixed[0].device
        try:
            memory = mapped_host_bytes(total, self.device)
        except RuntimeError as exc:
            raise RuntimeError(f"the prefix cache's host tier (prefix_cache.host_gb, {total / 2**30:.1f} GiB): {exc}") from exc
        mirrors = []
        for (tensor, rows), offset in zip(tensors, offsets):
            size = rows * _row_bytes(tensor)
            host = memory.host[offset : offset + size].view(rows, -1)
            cache_rows, mirror = _word_view(_byte_rows(tensor), memory.device[offset : offset + size].view(rows, -1))
            mirrors.append(Mirror(cache_rows, mirror, host))
        self.fixed, self.paged = mirrors[: len(fixed)], mirrors[len(fixed) :]
        self.slots, self.pages = slots, pages
        self.gpu_slots = min(m.cache.shape[0] for m in self.fixed)  # last_logits has no scratch slot
        self.gpu_pages = cache.num_pages
        self.hot = cache.hot
        self.nbytes = total

    def spill(self, moves: Sequence[TierMove]) -> None:
        """GPU -> host: every move's slot and pages, one indexed copy per tensor for all of them."""
        slots, pages = [m.slot for m in moves], [p for m in moves for p in m.pages]
        _check_pairs("spill", "slot", slots, self.gpu_slots, self.slots)
        _check_pairs("spill", "page", pages, self.gpu_pages, self.pages)
        _copy_rows(self.fixed, slots, to_host=True)
        _copy_rows(self.paged, pages, to_host=True)

    def load(self, moves: Sequence[TierMove]) -> None:
        """Host -> GPU: every move's slot and pages; the KV host tier's GPU ring re-copies the pages it
        holds (as ModelCache.copy_pages does), since their host copies changed under it."""
        slots, pages = [m.slot for m in moves], [p for m in moves for p in m.pages]
        _check_pairs("load", "slot", slots, self.slots, self.gpu_slots)
        _check_pairs("load", "page", pages, self.pages, self.gpu_pages)
        _copy_rows(self.fixed, slots, to_host=False)
        _copy_rows(self.paged, pages, to_host=False)
        if self.hot is not None and pages:
            self.hot.refresh([target for _, target in pages])

    def ready(self) -> torch.cuda.Event | None:
        """On CUDA, an event after the GPU work queued so far on the compute stream (spills written into
        host rows, loads' reads of them); None off CUDA, where every copy has happened on return."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # a thread waiting on it sleeps instead of spinning
        event.record(torch.cuda.current_stream(self.device))
        return event


def _copy_rows(mirrors: list[Mirror], pairs: list[tuple[int, int]], to_host: bool) -> None:
    if not pairs:
        return
    device = mirrors[0].cache.device
    source, target = _indices([s for s, _ in pairs], device), _indices([t for _, t in pairs], device)
    for m in mirrors:
        if to_host:
            m.mirror[target] = m.cache[source]
        else:
            m.cache[target] = m.mirror[source]


class RecordFile:
    """One file of fixed-size sealed records, each a row of every mirror (the module docstring's layout)."""

    def __init__(self, path: Path, records: int, mirrors: list[Mirror]) -> None:
        self.path, self.records, self.mirrors = path, records, mirrors
        self.nbytes = sum(m.row_bytes for m in mirrors)
        self.pages = disk_record_pages(self.nbytes)
        if records * self.pages > MAX_FILE_PAGES:
            raise ValueError(f"{path}: {records} records of {self.pages} pages pass the {MAX_FILE_PAGES} pages a file can"
                             " number: lower prefix_cache.disk_gb")
        self.fd = _open_records(path, records * self.pages * PAGE)

    def page_numbers(self, record: int) -> range:
        return range(record * self.pages, (record + 1) * self.pages)

    def payloads(self, rows: list[int]) -> np.ndarray:
        """The records of host rows `rows`: [len(rows), pages, PAYLOAD] bytes, zero padded."""
        index = torch.tensor(rows, dtype=torch.long)
        out = np.zeros((len(rows), self.pages * PAYLOAD), dtype=np.uint8)
        out[:, : self.nbytes] = torch.cat([m.host[index] for m in self.mirrors], dim=1).numpy()
        return out.reshape(len(rows), self.pages, PAYLOAD)

    def store(self, pages: np.ndarray, rows: list[int]) -> None:
        """Verified disk pages [len(rows) * pages, PAGE] of whole records into host rows `rows`."""
        payload = pages.reshape(len(rows), self.pages, PAGE)[:, :, :PAYLOAD].reshape(len(rows), -1)
        index, offset = torch.tensor(rows, dtype=torch.long), 0
        for m in self.mirrors:
            m.host[index] = torch.from_numpy(payload[:, offset : offset + m.row_bytes])
            offset += m.row_bytes

    def write(self, record: int, payload: np.ndarray, seal: int, buffer: mmap.mmap) -> None:
        """One record's pages sealed into the aligned `buffer`, then one O_DIRECT write."""
        first = record * self.pages
        for j in range(self.pages):
            buffer[j * PAGE : (j + 1) * PAGE] = seal_page(payload[j].tobytes(), first + j, seal)
        size = self.pages * PAGE
        written = os.pwrite(self.fd, memoryview(buffer)[:size], first * PAGE)
        if written != size:
            raise OSError(errno.EIO, f"short write ({written} of {size} bytes)")

    def where(self, page_no: int) -> str:
        return f"{self.path} record {page_no // self.pages} (page {page_no})"

    def close(self) -> None:
        """Durable on return: every record written so far, and the file's extents."""
        os.fdatasync(self.fd)
        os.close(self.fd)


def _open_records(path: Path, nbytes: int) -> int:
    """The file for O_DIRECT writes, at least `nbytes` long (extended, never truncated)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ValueError(f"prefix_cache.dir {path.parent}: its filesystem refuses O_DIRECT (tmpfs?); put it on"
                             " a disk") from exc
        raise
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def _verify(page: memoryview, page_no: int, seal: int) -> str | None:
    """check_page, with a stale or never-written record said as such."""
    why = check_page(page, page_no, seal)
    if why is None or len(page) != PAGE:
        return why
    stored_page, stored_seal, crc = TRAILER.unpack_from(page, PAYLOAD)
    if stored_page == stored_seal == crc == 0:
        return "never written (a zero page)"
    if stored_seal != seal:
        return f"stale seal {stored_seal:#x}, expected {seal:#x} (another write's record, or a write that never finished)"
    return why


@dataclass(frozen=True)
class _Job:
    move: TierMove
    ready: torch.cuda.Event | None  # synchronised before the thread touches host rows (CUDA)


class DiskTier:
    """This rank's two record files, a writer and a reader thread (see the module docstring)."""

    def __init__(self, host: HostTier, directory: Path, slots: int, pages: int, queue_depth: int = 64) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.files = (RecordFile(directory / "slots.bin", slots, host.fixed),
                      RecordFile(directory / "pages.bin", pages, host.paged))
        self.reader = UringPageReader([f.path for f in self.files], queue_depth)
        self.completions: queue.SimpleQueue[TierDone] = queue.SimpleQueue()
        self._buffer = mmap.mmap(-1, max(f.pages for f in self.files) * PAGE)  # page aligned, for O_DIRECT
        self._writes: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._fetches: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, args=(self._writes, self._write), name="ds4serve-prefix-writer", daemon=True),
            threading.Thread(target=self._serve, args=(self._fetches, self._fetch), name="ds4serve-prefix-reader", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        # a daemon thread inside a torch op while the interpreter tears torch down aborts the process
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- the runner's side -----------------------------------------------------------------------
    def write(self, moves: Sequence[TierMove], ready: torch.cuda.Event | None) -> None:
        """Queues host -> disk moves (host rows the scheduler keeps until their TierDone); all or none."""
        host, disk = (self.host.slots, self.host.pages), (self.files[0].records, self.files[1].records)
        for move in moves:
            self._check(move, host, disk)
        for move in moves:
            self._writes.put(_Job(move, ready))

    def fetch(self, moves: Sequence[TierMove], ready: torch.cuda.Event | None) -> None:
        """Queues disk -> host moves (host rows the scheduler reserves until their TierDone); all or none."""
        host, disk = (self.host.slots, self.host.pages), (self.files[0].records, self.files[1].records)
        for move in moves:
            self._check(move, disk, host)
        for move in moves:
            self._fetches.put(_Job(move, ready))

    def finished(self, wait_s: float = 0.0) -> list[TierDone]:
        """The completions since the last call; with `wait_s`, blocks that long at most for a first one."""
        done = []
        try:
            done.append(self.completions.get(timeout=wait_s) if wait_s > 0 else self.completions.get_nowait())
            while True:
                done.append(self.completions.get_nowait())
        except queue.Empty:
            return done

    def close(self) -> None:
        """Stops both threads: queued moves not started are abandoned (never reported: the scheduler
        dies with the engine, and an unreported write is in no catalog), the one in progress finishes.
        Then both files are fdatasynced. Safe to call twice."""
        if not self._threads:
            return
        for jobs in (self._writes, self._fetches):
            while True:
                try:
                    jobs.get_nowait()
                except queue.Empty:
                    break
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.reader.close()
        for file in self.files:
            file.close()
        self._buffer.close()

    @staticmethod
    def _check(move: TierMove, sources: tuple[int, int], targets: tuple[int, int]) -> None:
        _check_pairs(move.kind, "slot", [move.slot], sources[0], targets[0])
        _check_pairs(move.kind, "page", move.pages, sources[1], targets[1])
        if len(move.seals) != 1 + len(move.pages) or not all(0 <= seal < 1 << 64 for seal in move.seals):
            raise ValueError(f"a {move.kind} move (ticket {move.ticket}) needs a u64 seal for its slot and each of its"
                             f" {len(move.pages)} pages, not {move.seals}")

    # -- the threads -----------------------------------------------------------------------------
    def _serve(self, jobs: queue.SimpleQueue, work: Callable[[_Job], TierDone]) -> None:
        while (job := jobs.get()) is not None:
            try:
                done = work(job)
            except Exception as exc:  # reported, never a dead thread the scheduler would wait on forever
                log.exception("prefix disk tier: %s (ticket %d) failed", job.move.kind, job.move.ticket)
                done = TierDone(job.move.ticket, f"prefix disk tier: {job.move.kind} failed: {type(exc).__name__}: {exc}")
            self.completions.put(done)

    def _records(self, move: TierMove) -> list[tuple[RecordFile, list[tuple[int, int]], tuple[int, ...]]]:
        """(file, (source, target) rows, seals) of a move's slot record and page records."""
        return [(self.files[0], [move.slot], move.seals[:1]), (self.files[1], list(move.pages), move.seals[1:])]

    def _write(self, job: _Job) -> TierDone:
        """Waits for the spills to land in host memory, then writes each record."""
        if job.ready is not None:
            job.ready.synchronize()
        for file, pairs, seals in self._records(job.move):
            if not pairs:
                continue
            payloads = file.payloads([source for source, _ in pairs])
            for payload, (_, record), seal in zip(payloads, pairs, seals):
                try:
                    file.write(record, payload, seal, self._buffer)
                except OSError as exc:
                    return TierDone(job.move.ticket, f"prefix disk tier: writing {file.path} record {record}: {exc}")
        return TierDone(job.move.ticket)

    def _fetch(self, job: _Job) -> TierDone:
        """Every page of the move in one read_pages call; the host rows only once all verified, and (on
        CUDA) once no load queued before the move still reads them."""
        records = self._records(job.move)
        keys: list[tuple[int, int]] = []
        seal_of: dict[tuple[int, int], int] = {}
        for file_index, (file, pairs, seals) in enumerate(records):
            for (record, _), seal in zip(pairs, seals):
                for page_no in file.page_numbers(record):
                    keys.append((file_index, page_no))
                    seal_of[(file_index, page_no)] = seal
        pages, failed = self.reader.read_pages(keys, lambda key, page: _verify(page, key[1], seal_of[key]))
        if failed:
            position = min(failed)
            file_index, page_no = keys[position]
            more = f" ({len(failed)} pages failed)" if len(failed) > 1 else ""
            pages_file = self.files[1]
            bad = sorted({keys[i][1] // pages_file.pages for i in failed if keys[i][0] == 1})
            return TierDone(job.move.ticket, f"prefix disk tier: {self.files[file_index].where(page_no)}:"
                            f" {failed[position]}{more}", tuple(bad))
        if job.ready is not None:
            job.ready.synchronize()
        start = 0
        for file, pairs, _ in records:
            end = start + len(pairs) * file.pages
            if pairs:
                file.store(pages[start:end], [target for _, target in pairs])
            start = end
        return TierDone(job.move.ticket)


def _close_at_exit(tier: weakref.ref[DiskTier]) -> None:
    alive = tier()
    if alive is not None:
        alive.close()


class Tickets:
    """The asynchronous moves in flight, in issue order. With tensor parallelism every rank has its own
    disk tier and threads, and the scheduler may load a fetched point as soon as it sees its TierDone,
    so a move is reported only once every rank has finished it (failed if it failed on any): every rank
    runs the same plans, so all agree on what is in flight, and one sum over the group per step, only
    while moves are in flight, says which moves every rank finished."""

    def __init__(self, tp: TensorParallel, device: torch.device | str) -> None:
        self.tp, self.device = tp, device
        self.in_flight: dict[int, TierDone | None] = {}  # ticket -> this rank's completion (None: not yet)

    def issue(self, moves: Sequence[TierMove]) -> None:
        tickets = [move.ticket for move in moves]
        reused = [t for t in tickets if t in self.in_flight] or [t for t in tickets if tickets.count(t) > 1]
        if reused:
            raise ValueError(f"tier move ticket {reused[0]} is already in flight")
        self.in_flight.update(dict.fromkeys(tickets))

    def finish(self, done: list[TierDone]) -> tuple[TierDone, ...]:
        """This rank's new completions -> the moves every rank has finished."""
        for completion in done:
            self.in_flight[completion.ticket] = completion
        if self.tp.world_size == 1:
            for completion in done:
                self.in_flight.pop(completion.ticket, None)
            return tuple(done)
        if not self.in_flight:
            return ()
        tickets = list(self.in_flight)
        mine = [self.in_flight[t] for t in tickets]
        flags = torch.tensor([[c is not None for c in mine], [c is not None and c.error is not None for c in mine]],
                             dtype=torch.int32, device=self.device)
        finished, failed = self.tp.all_reduce(flags).tolist()
        out = []
        for ticket, completion, ranks, failures in zip(tickets, mine, finished, failed):
            if ranks == self.tp.world_size:
                del self.in_flight[ticket]
                if failures and completion.error is None:
                    completion = TierDone(ticket, "the move failed on another tensor-parallel rank")
                elif failures:  # which records failed on the other ranks is not known here
                    completion = TierDone(ticket, completion.error)
                out.append(completion)
        return tuple(out)
