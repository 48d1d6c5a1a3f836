"""The disk tier's catalog: which state points `prefix_cache.dir` holds, so they survive a restart.

The scheduler owns the disk tier's bookkeeping (scheduler/prefix_tiers.py: one `DiskEntry` per committed
point: salt, tokens, has_logits, disk slot, disk pages, seals, hits); this module keeps it on disk and
refuses a directory that another checkpoint or cache layout wrote (docs/prefix-tiers.md, "Restart").

The file, `<dir>/catalog.bin`, is replaced whole and atomically (a temp file, fsync, rename, fsync of
the directory), so a crash leaves the old catalog or the new one, never a torn one:

    MAGIC (8 bytes)  u32 header length  header (JSON)  body

The header holds the format version, the fingerprint's parts, the salts, the entry, token and page
counts and the body's crc32. The body (little-endian) is the entries' heads (ENTRY), then every
entry's new tokens (u32), new pages (u32) and those pages' seals (u64), each entry's after the one
before it. Entries are front coded: an entry whose tokens extend an earlier entry's (a conversation's
later points extend its earlier ones) names it as its parent and stores only the tokens after it, and
the leading pages (with their seals) it shares with it; so a long chat's points store its tokens once.

A catalog may lag the scheduler (it is written at most once a second, off the loop) or list records
since overwritten: both are safe, because every disk record is sealed and a fetch checks the seal the
catalog lists (a point whose record changed fails the check and is recomputed). A catalog that cannot
be read is an error, never an empty tier: something wrote that directory that this server does not
understand.

The fingerprint names what the records' bytes depend on: the checkpoint (config.json's bytes; each
safetensors file's name, size, JSON header and SAMPLED_BLOCKS blocks of 64 KiB of its data, not the
whole file: checkpoints are 150 GB) and the cache layout (engine/factory.py `catalog_fingerprint`).
Its parts are kept, so a refusal says which differ.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.prefix_tiers import DiskEntry

log = logging.getLogger("ds4serve.engine")

CATALOG = "catalog.bin"
LOCK = "lock"  # flock()ed by the server using the directory
MAGIC = b"DS4PFXCT"
VERSION = 1
HEADER_LENGTH = struct.Struct("<I")
# parent entry (-1: none), salt index, disk slot, has_logits, hits, the slot record's seal, tokens after the
# parent's, leading pages shared with the parent, pages after those
ENTRY = struct.Struct("<iiIBQQIII")
PARENT_TRIES = 8  # earlier entries tried as an entry's parent
SAMPLED_BLOCKS = 8
BLOCK = 64 * 2**10
SHOWN_VALUE = 24  # a differing part is shown with its values when both are this short (not digests)
SHOWN_PARTS = 6
FIX = "delete the directory, or point prefix_cache.dir elsewhere"


class PrefixCatalogError(ValueError):
    """A catalog this server must not use; the message names the directory or file and what to do."""


def digest(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """Named parts (name -> value); two catalogs agree when every part does."""

    parts: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, parts: Mapping[str, str]) -> "Fingerprint":
        return cls(tuple((str(k), str(v)) for k, v in parts.items()))

    def differences(self, stored: "Fingerprint") -> list[str]:
        """What differs from `stored` (the catalog's), in words: "dtype float32 -> bfloat16", "config.json"."""
        mine, theirs = dict(self.parts), dict(stored.parts)
        out = []
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            was, now = theirs.get(key), mine.get(key)
            if was == now:
                continue
            if was is None:
                out.append(f"{key} (not in the catalog's)")
            elif now is None:
                out.append(f"{key} (only in the catalog's)")
            elif len(was) <= SHOWN_VALUE and len(now) <= SHOWN_VALUE:
                out.append(f"{key} {was} -> {now}")
            else:
                out.append(key)
        return out


def checkpoint_parts(model_dir: Path) -> dict[str, str]:
    """The checkpoint's parts of a fingerprint: config.json, then each safetensors file's size, header
    and sampled data (reads a few blocks per file, whatever its size)."""
    parts = {"config.json": digest((model_dir / "config.json").read_bytes())}
    files = sorted(model_dir.glob("*.safetensors"))
    parts["safetensors files"] = digest("\n".join(f.name for f in files).encode())
    for path in files:
        parts.update(safetensors_parts(path))
    return parts


def safetensors_parts(path: Path) -> dict[str, str]:
    size = path.stat().st_size
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            raise PrefixCatalogError(f"{path}: not a safetensors file (header of {length} bytes in {size})")
        header = f.read(length)
        blocks = []
        for offset in sample_offsets(8 + length, size):
            f.seek(offset)
            blocks.append(f.read(BLOCK))
    return {f"{path.name} size": str(size), f"{path.name} header": digest(header),
            f"{path.name} data": digest(*blocks)}


def sample_offsets(start: int, end: int) -> list[int]:
    """Where the sampled BLOCK-byte blocks of the data [start, end) begin: the first, the last, and
    evenly between (a data region of up to SAMPLED_BLOCKS blocks is read whole)."""
    span = max(0, end - start - BLOCK)
    return sorted({start + span * i // (SAMPLED_BLOCKS - 1) for i in range(SAMPLED_BLOCKS)})


class DirectoryLock:
    """An exclusive lock on prefix_cache.dir for as long as one server uses it. Two servers on one
    directory would hand out the same record numbers and each rewrite the catalog whole: the seals would
    keep every served state right, but the first server's points would silently vanish (overlapping
    containers during a redeploy). flock() is released by the kernel when the process ends, so a
    crashed server leaves no stale lock."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self._file = open(self.path, "a")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._file.close()
            raise PrefixCatalogError(
                f"prefix_cache.dir {directory}: another server is using it ({self.path} is locked); stop it, or"
                " point prefix_cache.dir elsewhere") from exc

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def load_catalog(directory: Path, fingerprint: Fingerprint) -> list[DiskEntry]:
    """The committed entries of `directory`'s catalog. A directory without one gets an empty catalog now,
    marking it as this server's before any record is written. Raises PrefixCatalogError for a catalog of
    another fingerprint (naming the parts that differ) and for one that cannot be read."""
    path = directory / CATALOG
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        write_catalog(directory, fingerprint, [])
        return []
    except OSError as exc:
        raise PrefixCatalogError(f"{path}: cannot read the prefix catalog: {exc.strerror}") from exc
    header, body = _split(data, path)
    stored = Fingerprint.of(_field(header, "fingerprint", dict, path))
    if stored != fingerprint:
        differs = fingerprint.differences(stored)
        shown = ", ".join(differs[:SHOWN_PARTS]) + (f" and {len(differs) - SHOWN_PARTS} more"
                                                     if len(differs) > SHOWN_PARTS else "")
        raise PrefixCatalogError(
            f"prefix_cache.dir {directory}: its catalog was written for another checkpoint or cache layout"
            f" (differs: {shown}); {FIX}"
        )
    return _decode(header, body, path)


def write_catalog(directory: Path, fingerprint: Fingerprint, entries: Sequence[DiskEntry]) -> None:
    """Replaces the catalog atomically (temp file, fsync, rename, fsync of the directory)."""
    data = encode(fingerprint, entries)
    path, temp = directory / CATALOG, directory / (CATALOG + ".tmp")
    with temp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(fingerprint: Fingerprint, entries: Sequence[DiskEntry]) -> bytes:
    """The catalog file's bytes (the module docstring's format)."""
    salts: dict[str | None, int] = {}
    heads, tokens, pages, seals = [], [], [], []
    for parent_at, entry, parent in _front_coded(entries):
        if len(entry.seals) != len(entry.pages) + 1:
            raise ValueError(f"disk entry at slot {entry.slot}: {len(entry.seals)} seals for {len(entry.pages)} pages"
                             " (the slot record's, then one per page)")
        shared_tokens = len(parent.tokens) if parent is not None else 0
        shared_pages = _shared_pages(parent, entry) if parent is not None else 0
        salt = salts.setdefault(entry.salt, len(salts))
        heads.append(ENTRY.pack(parent_at, salt, entry.slot, entry.has_logits, entry.hits, entry.seals[0],
                                len(entry.tokens) - shared_tokens, shared_pages, len(entry.pages) - shared_pages))
        tokens.append(entry.tokens[shared_tokens:])
        pages.append(entry.pages[shared_pages:])
        seals.append(entry.seals[1 + shared_pages:])
    body = b"".join([
        b"".join(heads),
        _packed(tokens, "<u4"),
        _packed(pages, "<u4"),
        _packed(seals, "<u8"),
    ])
    header = json.dumps({
        "version": VERSION, "fingerprint": dict(fingerprint.parts), "salts": list(salts),
        "entries": len(heads), "tokens": sum(map(len, tokens)), "pages": sum(map(len, pages)),
        "body_crc32": zlib.crc32(body),
    }).encode()
    return MAGIC + HEADER_LENGTH.pack(len(header)) + header + body


def _front_coded(entries: Sequence[DiskEntry]) -> list[tuple[int, DiskEntry, DiskEntry | None]]:
    """The entries, shortest first, each with the index of its parent (-1: none) and the parent itself:
    the longest earlier entry of the same salt and first page whose tokens it extends. Candidates share
    the first page (the tiers share full pages between a conversation's points), and the check is one
    tuple comparison; at most PARENT_TRIES candidates per entry, so a wide tree costs no more."""
    ordered = sorted(entries, key=lambda e: len(e.tokens))
    groups: dict[tuple[str | None, int | None], list[int]] = {}
    out: list[tuple[int, DiskEntry, DiskEntry | None]] = []
    for position, entry in enumerate(ordered):
        group = groups.setdefault((entry.salt, entry.pages[0] if entry.pages else None), [])
        parent = next((i for i in itertools.islice(reversed(group), PARENT_TRIES)
                       if entry.tokens[: len(ordered[i].tokens)] == ordered[i].tokens), -1)
        out.append((parent, entry, ordered[parent] if parent >= 0 else None))
        group.append(position)
    return out


def _shared_pages(parent: DiskEntry, entry: DiskEntry) -> int:
    """Leading pages (and seals) `entry` shares with `parent`: all of the parent's when its last page is
    full, else all but that partial last page (which is the parent's own); 0 when neither holds."""
    for count in (len(parent.pages), len(parent.pages) - 1):
        if count > 0 and entry.pages[:count] == parent.pages[:count] \
                and entry.seals[1:1 + count] == parent.seals[1:1 + count]:
            return count
    return 0


def _packed(chunks: list[Sequence[int]], dtype: str) -> bytes:
    count = sum(map(len, chunks))
    return np.fromiter(itertools.chain.from_iterable(chunks), dtype=dtype, count=count).tobytes()


def _split(data: bytes, path: Path) -> tuple[dict[str, Any], memoryview]:
    """(header, body) of a catalog file; refuses another magic or version and a short or unparsable header."""
    start = len(MAGIC) + HEADER_LENGTH.size
    if data[: len(MAGIC)] != MAGIC or len(data) < start:
        raise _corrupt(path, "not a prefix catalog (bad magic)")
    (length,) = HEADER_LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + length])
    except ValueError as exc:
        raise _corrupt(path, f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "unreadable header")
    if header.get("version") != VERSION:
        raise PrefixCatalogError(f"{path}: prefix catalog format version {header.get('version')}, this server"
                                 f" reads {VERSION}; {FIX}")
    return header, memoryview(data)[start + length:]


def _decode(header: dict[str, Any], body: memoryview, path: Path) -> list[DiskEntry]:
    salts = _field(header, "salts", list, path)
    n, n_tokens, n_pages = (_field(header, key, int, path) for key in ("entries", "tokens", "pages"))
    if min(n, n_tokens, n_pages) < 0 or any(s is not None and not isinstance(s, str) for s in salts) \
            or len(body) != n * ENTRY.size + 4 * n_tokens + 12 * n_pages:
        raise _corrupt(path, f"{len(body)} body bytes for {n} entries, {n_tokens} tokens and {n_pages} pages")
    if zlib.crc32(body) != _field(header, "body_crc32", int, path):
        raise _corrupt(path, "checksum mismatch")
    at = n * ENTRY.size
    tokens = np.frombuffer(body, "<u4", n_tokens, at).tolist()
    pages = np.frombuffer(body, "<u4", n_pages, at + 4 * n_tokens).tolist()
    seals = np.frombuffer(body, "<u8", n_pages, at + 4 * (n_tokens + n_pages)).tolist()
    entries: list[DiskEntry] = []
    next_token = next_page = 0
    for i, head in enumerate(ENTRY.iter_unpack(body[:at])):
        parent_at, salt, slot, has_logits, hits, slot_seal, new_tokens, shared_pages, new_pages = head
        parent = entries[parent_at] if 0 <= parent_at < i else None
        if (parent is None and (parent_at != -1 or shared_pages)) or not 0 <= salt < len(salts) \
                or (parent is not None and shared_pages > len(parent.pages)) \
                or next_token + new_tokens > n_tokens or next_page + new_pages > n_pages:
            raise _corrupt(path, f"entry {i} is inconsistent")
        own = slice(next_page, next_page + new_pages)
        entries.append(DiskEntry(
            salt=salts[salt],
            tokens=(parent.tokens if parent else ()) + tuple(tokens[next_token:next_token + new_tokens]),
            has_logits=bool(has_logits),
            slot=slot,
            pages=(parent.pages[:shared_pages] if parent else ()) + tuple(pages[own]),
            seals=(slot_seal,) + (parent.seals[1:1 + shared_pages] if parent else ()) + tuple(seals[own]),
            hits=hits,
        ))
        next_token, next_page = next_token + new_tokens, next_page + new_pages
    if (next_token, next_page) != (n_tokens, n_pages):
        raise _corrupt(path, "the entries do not account for every token and page")
    return entries


def _field(header: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _corrupt(path, f"header field {key!r} missing or not a {kind.__name__}")
    return value


def _corrupt(path: Path, why: str) -> PrefixCatalogError:
    return PrefixCatalogError(f"{path}: corrupt prefix catalog ({why}); {FIX}")


class CatalogWriter:
    """Persists the catalog off the engine loop. The loop offers the scheduler's committed entries when its
    disk_version moved, at most once per `interval_s` (and a last time as it ends: `final`); a thread of
    its own encodes and writes them, a newer offer replacing one not yet taken. The loop's share is one
    `entries()` call a second at most; it never waits on the disk (a slow disk only makes the catalog lag,
    which is safe: see the module docstring)."""

    def __init__(self, directory: Path, fingerprint: Fingerprint, version: int, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, lock: DirectoryLock | None = None) -> None:
        """`version`: the scheduler's disk_version that the catalog on disk already holds; `lock`: the
        directory's, released after the last write (close)."""
        self.directory, self.fingerprint, self.interval_s, self._clock = directory, fingerprint, interval_s, clock
        self._lock = lock
        self._offered, self._offered_at = version, clock()
        self.written_version = version
        self._pending: tuple[int, list[DiskEntry]] | None = None
        self._closing = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ds4serve-prefix-catalog", daemon=True)
        self._thread.start()

    def offer(self, version: int, entries: Callable[[], list[DiskEntry]], final: bool = False) -> None:
        """On the loop thread, after a step (or as the loop ends, with `final`)."""
        if version == self._offered or (not final and self._clock() - self._offered_at < self.interval_s):
            return
        snapshot = entries()
        with self._ready:
            self._pending = (version, snapshot)
            self._ready.notify()
        self._offered, self._offered_at = version, self._clock()

    def close(self, timeout: float = 30.0) -> None:
        """Writes what was offered last, then ends the thread (waits up to `timeout` seconds)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout)
        if self._lock is not None and not self._thread.is_alive():
            self._lock.release()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._pending is None and not self._closing:
                    self._ready.wait()
                if self._pending is None:
                    return
                (version, entries), self._pending = self._pending, None
            try:
                write_catalog(self.directory, self.fingerprint, entries)
            except Exception:  # the catalog on disk stays the previous one (safe, it only lags); serving goes on
                log.exception("could not write the prefix catalog in %s", self.directory)
            else:
                self.written_version = version
