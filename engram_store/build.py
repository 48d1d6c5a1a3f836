"""Opens a checkpoint's Engram tables in the tiers the config asks for (store.py).

RESIDENCIES is the one list of residency names: what each one's tier holds where (the memory plan,
`python -m server plan`, reads it), whether it reads table files (converted first, read by whole-table
row id under tensor parallelism), and how its tier is opened. A new tier is a new entry here.

Disk tiers read table files from `engram.path` (default MODEL_DIR/engram), written by the store's
`TableSource` on first use: converted from the checkpoint (`CheckpointTables`), or drawn from a seed
for dummy weights (models/dummy_engram.py). Each file is checked on open against the source it is to
serve (format version, the source's digest: source.py for a checkpoint; its size): a table of another
checkpoint, of these weights before they changed, or of an older format is written again with a
warning naming the file when `engram.path` is the default (the server owns that directory), and
refused at start when it is set (the operator's files: the message names the file and what to run).
A damaged file (bad header, truncated) is refused either way. Refused with a message naming the key: a
residency name not in RESIDENCIES, disk residency on tmpfs / ramfs (O_DIRECT would bypass nothing: the
"disk" is RAM), a table whose layout differs from the config's, and resident scales over files that
keep their scales inline.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Literal, Protocol

import numpy as np
import torch

from engram_store.cache import RowCache
from engram_store.convert import convert_tables, open_table, table_file, tensor_files
from engram_store.format import StaleTableError, TableFormatError, TableHeader
from engram_store.hashing import EngramLayout
from engram_store.source import source_digest, source_tensors
from engram_store.store import (
    DiskLayer,
    DiskTier,
    EngramOptions,
    EngramStore,
    EngramTier,
    ResidentLayer,
    ResidentTier,
    StoreStats,
)
from engram_store.uring import UringPageReader

log = logging.getLogger("ds4serve.engram")
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}
TableReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (layer id, head_dim) -> values, scales


class EngramConfigError(ValueError):
    """An engram: setting that cannot work; names the key."""


class TableSource(Protocol):
    """Where the table files of the disk tiers come from. `digest(layer)` is what a file must record
    (TableHeader.source_digest) to hold this source's rows; `write` makes the missing ones (rows in the
    layout's order); `remedy` says what an operator runs to replace a stale file at an explicit path."""

    default_dir: Path  # where the files go without engram.path

    def digest(self, layer: int) -> str: ...

    def write(self, out_dir: Path, layout: EngramLayout, scale_layout: str, layers: Collection[int]) -> None: ...

    def remedy(self, out_dir: Path, scale_layout: str) -> str: ...


@dataclass(frozen=True)
class CheckpointTables:
    """Table files converted from a checkpoint's `model.engram_tables.<L>.weight` tensors (convert.py)."""

    model_dir: Path

    @property
    def default_dir(self) -> Path:
        return self.model_dir / "engram"

    def digest(self, layer: int) -> str:
        files = tensor_files(self.model_dir)
        return source_digest(files, source_tensors(files, layer, self.model_dir))

    def write(self, out_dir: Path, layout: EngramLayout, scale_layout: str, layers: Collection[int]) -> None:
        log.info("converting Engram layers %s of %s into %s", sorted(layers), self.model_dir, out_dir)
        convert_tables(self.model_dir, out_dir, layout, scale_layout, progress=True, layers=set(layers))

    def remedy(self, out_dir: Path, scale_layout: str) -> str:
        separate = " --scales separate" if scale_layout == "separate" else ""
        command = f"python -m engram_store.convert {self.model_dir} --out {out_dir}{separate}"
        return f"reconvert the tables for this checkpoint: {command}"


@dataclass(frozen=True)
class TierInputs:
    """What opening any tier may need: the tables' source, their layout, the options and the compute device."""

    layout: EngramLayout
    head_dim: int
    tables: TableSource
    read_table: TableReader
    options: EngramOptions
    device: str
    stats: StoreStats

    @property
    def directory(self) -> Path:
        """Where the table files are (engram.path, default the source's: MODEL_DIR/engram for a checkpoint)."""
        return self.options.path or self.tables.default_dir


TierOpener = Callable[[TierInputs, dict[int, int]], EngramTier]  # (inputs, layer index -> layer id) -> tier


@dataclass(frozen=True)
class Residency:
    """One `engram.residency` value."""

    name: str
    table_in: Literal["device", "host", "file"]  # where the whole table lives (a file is read through row caches)
    open: TierOpener

    @property
    def reads_files(self) -> bool:
        """Rows come from the shared table files: converted before first use, read by whole-table row id."""
        return self.table_in == "file"


def _open_resident(inputs: TierInputs, layers: dict[int, int], on_device: bool) -> ResidentTier:
    resident = {}
    for index, layer in layers.items():
        values, scales = inputs.read_table(layer, inputs.head_dim)
        where = inputs.device if on_device else "cpu"
        values, scales = values.to(where), scales.to(where)
        if not on_device and torch.cuda.is_available():
            values, scales = values.pin_memory(), scales.pin_memory()
        resident[index] = ResidentLayer(values, scales, inputs.device)
    return ResidentTier(resident, inputs.stats)


def _open_on_device(inputs: TierInputs, layers: dict[int, int]) -> ResidentTier:
    return _open_resident(inputs, layers, on_device=True)


def _open_in_host_memory(inputs: TierInputs, layers: dict[int, int]) -> ResidentTier:
    return _open_resident(inputs, layers, on_device=False)


def _open_disk(inputs: TierInputs, layers: dict[int, int]) -> DiskTier:
    """The layers' table files (checked, and converted first where missing or stale: _open_tables)
    behind one reader, with row caches sized
    by the options' byte budgets shared out in proportion to each layer's row width."""
    directory, options, device = inputs.directory, inputs.options, inputs.device
    _check_filesystem(directory)
    paths = {index: table_file(directory, layer) for index, layer in layers.items()}
    headers = _open_tables(inputs, layers, paths)
    row_bytes = sum(header.row_bytes for header in headers.values())
    host_rows, device_rows = options.host_cache_bytes // row_bytes, options.gpu_cache_bytes // row_bytes
    disk = {}
    for file_index, (index, header) in enumerate(headers.items()):
        primes = [p for order in inputs.layout.primes[index] for p in order]
        _check_layout(header, inputs.layout.num_embeddings[index], primes, inputs.head_dim, paths[index])
        scales = _resident_scales(header, paths[index]) if options.resident_scales else None
        device_cache = RowCache(min(device_rows, header.rows), header.row_bytes, device) if device_rows else None
        host_cache = RowCache(min(host_rows, header.rows), header.row_bytes,
                              compute_device=device if torch.device(device).type == "cuda" else None)
        disk[index] = DiskLayer(header, file_index, host_cache, device_cache, scales, device)
    return DiskTier(disk, UringPageReader(list(paths.values()), options.queue_depth), inputs.stats)


def _open_tables(inputs: TierInputs, layers: dict[int, int], paths: dict[int, Path]) -> dict[int, TableHeader]:
    """Each layer's table header, the file checked against the tables' source (convert.open_table).
    Missing files are written; foreign, stale or old-format ones too at the default path (with a
    warning naming each), refused at an explicit one; damaged files are refused."""
    digests = {index: inputs.tables.digest(layer) for index, layer in layers.items()}
    scale_layout = "separate" if inputs.options.resident_scales else "inline"
    remedy = inputs.tables.remedy(inputs.directory, scale_layout)
    headers: dict[int, TableHeader] = {}
    missing: dict[int, int] = {}
    for index, layer in layers.items():
        try:
            headers[index] = open_table(paths[index], digests[index])
        except FileNotFoundError:
            missing[index] = layer
        except StaleTableError as exc:
            if inputs.options.path is not None:
                raise EngramConfigError(f"engram.path: {exc}; {remedy}") from exc
            log.warning("%s; reconverting it", exc)
            missing[index] = layer
        except TableFormatError as exc:
            raise EngramConfigError(f"engram.path: {exc}; {remedy}") from exc
    if missing:
        inputs.tables.write(inputs.directory, inputs.layout, scale_layout, set(missing.values()))
        headers.update({index: open_table(paths[index], digests[index]) for index in missing})
    return {index: headers[index] for index in layers}  # in the layers' order, as the reader's files are


RESIDENCIES: dict[str, Residency] = {
    residency.name: residency
    for residency in (
        Residency("gpu", "device", _open_on_device),
        Residency("host", "host", _open_in_host_memory),
        Residency("disk", "file", _open_disk),
    )
}


def check_residencies(options: EngramOptions) -> None:
    """Every residency the options name is one of RESIDENCIES; the message names the key."""
    keys = [("engram.residency", options.residency)]
    keys += [(f"engram.layers.{layer}.residency", name) for layer, name in options.layer_residency.items()]
    for key, name in keys:
        if name not in RESIDENCIES:
            raise EngramConfigError(f"{key}: {name!r} is not one of {', '.join(RESIDENCIES)}")


def build_store(layout: EngramLayout, head_dim: int, model_dir: Path, read_table: TableReader, options: EngramOptions,
                device: str, tables: TableSource | None = None) -> EngramStore:
    """The store of `layout`'s layers, each in the tier its residency names; table files come from
    `tables` (default: converted from the checkpoint in `model_dir`)."""
    check_residencies(options)
    by_residency: dict[str, dict[int, int]] = {}
    for index, layer in enumerate(layout.layer_ids):
        by_residency.setdefault(options.residency_of(layer), {})[index] = layer
    inputs = TierInputs(layout, head_dim, tables or CheckpointTables(model_dir), read_table, options, device,
                        StoreStats())
    tiers = {name: RESIDENCIES[name].open(inputs, layers) for name, layers in by_residency.items()}
    return EngramStore(tiers, inputs.stats)


def _check_filesystem(directory: Path) -> None:
    kind = filesystem_type(directory if directory.exists() else directory.parent)
    if kind in RAM_FILESYSTEMS:
        raise EngramConfigError(
            f"engram.residency: disk on {directory} ({kind}) would read from RAM, not NVMe; use residency host,"
            " or put engram.path on a disk"
        )


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount point prefix in /proc/mounts)."""
    target, best, kind = str(path.resolve()), "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fs_type
    return kind


def _check_layout(header: TableHeader, rows: int, primes: list[int], head_dim: int, path: Path) -> None:
    if header.rows != rows or header.row_dim != head_dim or (header.primes and header.primes != primes):
        raise EngramConfigError(
            f"engram.path: {path} holds a table of {header.rows} rows x {header.row_dim} (primes {header.primes[:3]}...),"
            f" the checkpoint's layout needs {rows} x {head_dim}; reconvert it (python -m engram_store.convert)"
        )


def _resident_scales(header: TableHeader, path: Path) -> torch.Tensor:
    if header.scale_layout != "separate":
        raise EngramConfigError(
            f"engram.resident_scales: {path} keeps its scales inline; reconvert with --scales separate"
        )
    with open(path, "rb") as f:
        f.seek(header.scale_section_offset)
        section = f.read(header.scale_section_bytes)
    if zlib.crc32(section) != header.scale_section_crc:
        raise EngramConfigError(f"engram.resident_scales: {path}: the scale section fails its checksum")
    return torch.from_numpy(np.frombuffer(section, dtype=np.uint8).reshape(header.rows, header.scale_bytes).copy())
