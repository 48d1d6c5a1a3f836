"""Page reads through io_uring (PyPI `liburing`) with O_DIRECT into registered-size aligned buffers.

O_DIRECT needs page-aligned memory, so each in-flight read owns one anonymous mmap page (mmap is page
aligned) wrapped in an iovec; `queue_depth` of them are kept for the reader's lifetime. The reader
waits for completions on an eventfd registered with the ring (the GIL is free meanwhile), then reaps
them one CQE at a time until the queue is empty. Every completed page goes through `verify` (length,
page number, table id, checksum) before anyone sees it; a failed read or verification is retried
once, then reported per page, so a caller fails exactly the rows on that page.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import mmap
import os
import tempfile
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np

from engram_store.format import PAGE

LIBURING_IMPORT_LOCK = Path(tempfile.gettempdir()) / f"ds4serve-liburing-import-{os.getuid()}.lock"


def import_liburing() -> ModuleType:
    """Import `liburing` under an exclusive file lock shared by every process of this user.

    liburing's package loader (`dynamic_import`) keeps a cache file beside the package and, when it
    finds the cache stale, deletes and rebuilds it; two processes doing that at once (TP ranks that
    start together) race, and the loser's `remove` fails with FileNotFoundError. One importer at a
    time makes the rebuild happen once.
    """
    with open(LIBURING_IMPORT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return importlib.import_module("liburing")


liburing = import_liburing()

PageKey = tuple[int, int]  # (file index, page number)
Verifier = Callable[[PageKey, memoryview], "str | None"]


class UringPageReader:
    def __init__(self, paths: list[Path], queue_depth: int) -> None:
        self.queue_depth = max(1, queue_depth)
        self.paths = list(paths)  # by file index (a PageKey's first part), for messages
        self.fds = [os.open(path, os.O_RDONLY | os.O_DIRECT) for path in paths]
        self.ring = liburing.io_uring()
        liburing.io_uring_queue_init(2 * self.queue_depth, self.ring, 0)
        self.cqes = liburing.io_uring_cqe()
        self.buffers = [mmap.mmap(-1, PAGE) for _ in range(self.queue_depth)]
        self.iovecs = [liburing.iovec(memoryview(buffer)) for buffer in self.buffers]
        self.views = [np.frombuffer(buffer, dtype=np.uint8) for buffer in self.buffers]  # verified pages are copied from these
        # Completions also bump this eventfd: waiting on it (os.eventfd_read) releases the GIL and wakes
        # as soon as a read completes (the binding's own wait holds the GIL; sleeping overshoots).
        self.completions = os.eventfd(0, os.EFD_CLOEXEC)
        liburing.io_uring_register_eventfd(self.ring, self.completions)
        # Test hook: (file, page) -> errno to fail that read with, as a failing disk would.
        self.inject_error: Callable[[PageKey], int | None] | None = None
        self.reads = self.bytes_read = self.errors = 0

    def close(self) -> None:
        liburing.io_uring_queue_exit(self.ring)
        os.close(self.completions)
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def read_pages(self, keys: list[PageKey], verify: Verifier) -> tuple[np.ndarray, dict[int, str]]:
        """Reads and verifies `keys` (distinct). Returns the pages [len(keys), PAGE] in the keys' order
        (a failed key's row stays zero) and why each failed key, by its position, failed. The loop
        is the I/O thread's per-page cost, so it keeps Python work per page to a few calls."""
        pages = np.zeros((len(keys), PAGE), dtype=np.uint8)
        failed: dict[int, str] = {}
        pending: deque[tuple[int, int]] = deque((i, 0) for i in range(len(keys)))  # (key position, attempt)
        free = list(range(self.queue_depth))
        in_flight: list[tuple[int, int]] = [(0, 0)] * self.queue_depth  # by buffer: (key position, attempt)
        while pending or len(free) < self.queue_depth:  # work left, or reads in flight
            while pending and free:
                position, attempt = pending.popleft()
                buffer = free.pop()
                file, page = keys[position]
                sqe = liburing.io_uring_get_sqe(self.ring)
                liburing.io_uring_prep_readv(sqe, self.fds[file], self.iovecs[buffer], page * PAGE)
                sqe.user_data = buffer + 1  # the binding refuses 0
                in_flight[buffer] = (position, attempt)
            liburing.io_uring_submit(self.ring)
            for tag, result in self._reap():
                buffer = tag - 1
                position, attempt = in_flight[buffer]
                free.append(buffer)
                self.reads += 1
                key = keys[position]
                injected = self.inject_error(key) if self.inject_error else None
                if injected:
                    result = -injected
                why = self._check(key, result, self.buffers[buffer], verify)
                if why is None:
                    pages[position] = self.views[buffer]
                    self.bytes_read += PAGE
                elif attempt == 0:
                    pending.append((position, 1))  # once more: a transient error or a torn read heals
                else:
                    self.errors += 1
                    failed[position] = why
        return pages, failed

    def _reap(self) -> list[tuple[int, int]]:
        """Waits for one completion (on the eventfd: the binding's blocking wait keeps the GIL, which
        would stall the model's thread for the whole read), then takes every other ready one, one CQE at a time: the head CQE
        is re-read after each `seen`, because indexing past it would run off the end of the
        circular completion queue (the batch-indexing failure the reference notes)."""
        status = liburing.io_uring_peek_cqe(self.ring, self.cqes)
        while status == -errno.EAGAIN:
            os.eventfd_read(self.completions)  # blocks, GIL released, until a completion is posted
            status = liburing.io_uring_peek_cqe(self.ring, self.cqes)
        if status < 0:
            raise OSError(-status, f"io_uring_peek_cqe: {os.strerror(-status)}")
        completed = []
        while status == 0:
            completed.append((self.cqes.user_data, self.cqes.res))
            liburing.io_uring_cqe_seen(self.ring, self.cqes)
            status = liburing.io_uring_peek_cqe(self.ring, self.cqes)
        return completed

    @staticmethod
    def _check(key: PageKey, result: int, buffer: mmap.mmap, verify: Verifier) -> str | None:
        if result < 0:
            return f"read error {errno.errorcode.get(-result, -result)}"
        if result != PAGE:
            return f"short read ({result} of {PAGE} bytes)"
        return verify(key, memoryview(buffer))
