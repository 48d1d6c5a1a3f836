"""Opens a checkpoint's Engram tables in the tiers the config asks for (store.py).

Disk tiers read table files from `engram.path` (default MODEL_DIR/engram), converted from the
checkpoint on first use. Refused with a message naming the key: disk residency on tmpfs / ramfs
(O_DIRECT would bypass nothing: the "disk" is RAM), a table whose layout differs from the config's,
and resident scales over files that keep their scales inline.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engram_store.cache import RowCache
from engram_store.convert import convert_checkpoint, read_header, table_file
from engram_store.format import TableHeader
from engram_store.store import DiskLayer, EngramOptions, EngramStore, ResidentLayer
from engram_store.uring import UringPageReader

log = logging.getLogger("ds4serve.engram")
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}
TableReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class EngramConfigError(ValueError):
    """An engram: setting that cannot work; names the key."""


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


def build_store(
    layer_ids: tuple[int, ...],
    layer_rows: tuple[int, ...],
    primes: list[list[int]],
    head_dim: int,
    model_dir: Path,
    read_table: TableReader,
    options: EngramOptions,
    device: str,
) -> EngramStore:
    disk_layers = [layer for layer in layer_ids if options.residency_of(layer) == "disk"]
    directory = options.path or model_dir / "engram"
    if disk_layers:
        kind = filesystem_type(directory if directory.exists() else directory.parent)
        if kind in RAM_FILESYSTEMS:
            raise EngramConfigError(
                f"engram.residency: disk on {directory} ({kind}) would read from RAM, not NVMe; use residency host,"
                " or put engram.path on a disk"
            )
        missing = [layer for layer in disk_layers if not table_file(directory, layer).exists()]
        if missing:
            log.info("converting the Engram tables of %s into %s (first use)", model_dir, directory)
            convert_checkpoint(model_dir, directory, "separate" if options.resident_scales else "inline", progress=False)
    headers = {layer: read_header(table_file(directory, layer)) for layer in disk_layers}
    paths = [table_file(directory, layer) for layer in disk_layers]
    reader = UringPageReader(paths, options.queue_depth) if paths else None
    row_bytes = sum(headers[layer].row_bytes for layer in disk_layers)
    host_rows = options.host_cache_bytes // row_bytes if row_bytes else 0
    device_rows = options.gpu_cache_bytes // row_bytes if row_bytes else 0
    layers = []
    for index, (layer, rows) in enumerate(zip(layer_ids, layer_rows)):
        residency = options.residency_of(layer)
        if residency == "disk":
            header = headers[layer]
            _check_layout(header, rows, primes[index], head_dim, table_file(directory, layer))
            scales = _resident_scales(header, table_file(directory, layer)) if options.resident_scales else None
            device_cache = RowCache(min(device_rows, header.rows), header.row_bytes, device) if device_rows else None
            host_cache = RowCache(min(host_rows, header.rows), header.row_bytes,
                                  compute_device=device if torch.device(device).type == "cuda" else None)
            layers.append(DiskLayer(header, disk_layers.index(layer), host_cache, device_cache, scales, device))
        else:
            values, scales = read_table(layer, head_dim)
            where = device if residency == "gpu" else "cpu"
            values, scales = values.to(where), scales.to(where)
            if residency == "host" and torch.cuda.is_available():
                values, scales = values.pin_memory(), scales.pin_memory()
            layers.append(ResidentLayer(values, scales, device))
    return EngramStore(layers, reader, device)


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
