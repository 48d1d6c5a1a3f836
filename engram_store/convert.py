"""Writes Engram table files (format.py) from a checkpoint's safetensors tables, and verifies them.

    python -m engram_store.convert MODEL_DIR [--out DIR] [--scales inline|separate]
    python -m engram_store.verify DIR

Conversion streams: rows are read from safetensors a block at a time, so memory stays bounded
whatever the table size (the released tables are ~98 GB each). fp8 tables keep their power-of-two
scales as e8m0 bytes; float tables keep float32 scales. Each header records the digest of the tensors
it was converted from (source.py), so the server can tell a table of this checkpoint from another's.
With `progress`, each table shows its bytes written, rate and time left as "Engram table i of N"
(contract/progress.py: a bar on a terminal, else a log line now and then).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from contract.progress import Progress
from engram_store.format import (
    PAGE,
    StaleTableError,
    TableFormatError,
    TableHeader,
    check_page,
    seal_page,
)
from engram_store.hashing import EngramLayout
from engram_store.source import source_digest, source_tensors
from engram_store.spec import checkpoint_spec

ROWS_PER_BLOCK = 1 << 16
log = logging.getLogger("ds4serve.engram")


def table_file(directory: Path, layer_id: int) -> Path:
    return directory / f"engram_layer{layer_id}.tbl"


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """[n, d] tensor -> [n, d * itemsize] uint8 (the row's bytes as stored on disk)."""
    return tensor.contiguous().view(torch.uint8).numpy().reshape(tensor.shape[0], -1)


def _scale_bytes(scales: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "e8m0":
        mantissa, exponent = torch.frexp(scales.float())
        return (exponent - 1 + 127).to(torch.uint8).numpy()
    return _as_bytes(scales.float())


def block_bytes(values: torch.Tensor, scales: torch.Tensor, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A block of rows as write_table takes it: (value bytes [n, value_bytes], scale bytes [n, scale_bytes])."""
    return _as_bytes(values), _scale_bytes(scales, scale_dtype)


def layer_header(layout: EngramLayout, index: int, rows: int, dim: int, value_dtype: str, n_scales: int,
                 scale_layout: str, source_digest: str) -> TableHeader:
    """The header of layer `layout.layer_ids[index]`'s table: its layout's primes and offsets, a fresh
    table id, and the digest of what its rows were made from (source.py, or a dummy table's seed)."""
    return TableHeader(
        table_id=secrets.randbits(64), layer_id=layout.layer_ids[index], rows=rows, row_dim=dim,
        value_dtype=value_dtype, scale_dtype="e8m0" if value_dtype == "float8_e4m3fn" else "float32",
        scale_block=dim // n_scales, scale_layout=scale_layout,
        primes=[p for order in layout.primes[index] for p in order], offsets=list(layout.offsets[index]),
        source_digest=source_digest,
    )


def write_table(path: Path, header: TableHeader, blocks: Iterator[tuple[np.ndarray, np.ndarray]], progress: bool = False,
                label: str | None = None) -> TableHeader:
    """Writes a table from blocks of (value bytes [n, value_bytes], scale bytes [n, scale_bytes]) rows.
    Returns the header as written (with the scale section checksum). `label` names the table in the
    progress (default: the file's name)."""
    tmp = path.with_suffix(".partial")
    per_page, separate = header.rows_per_page, header.scale_layout == "separate"
    scale_crc, written, page_no = 0, 0, 1
    pending_values: list[np.ndarray] = []
    scale_chunks: list[np.ndarray] = []
    shown = Progress(label or path.name, header.rows * (header.value_bytes + header.scale_bytes), log, enabled=progress)
    with open(tmp, "wb") as out, shown:
        out.write(b"\0" * PAGE)  # header last, once the checksums are known

        def flush(rows: np.ndarray) -> None:
            nonlocal page_no
            n_pages = -(-rows.shape[0] // per_page)
            padded = np.zeros((n_pages * per_page, rows.shape[1]), dtype=np.uint8)
            padded[: rows.shape[0]] = rows
            for page in padded.reshape(n_pages, -1):
                out.write(seal_page(page.tobytes(), page_no, header.table_id))
                page_no += 1

        for values, scales in blocks:
            rows = values if separate else np.concatenate([values, scales], axis=1)
            if separate:
                scale_chunks.append(scales)
                scale_crc = zlib.crc32(scales.tobytes(), scale_crc)
            pending_values.append(rows)
            buffered = sum(r.shape[0] for r in pending_values)
            if buffered >= per_page:
                joined = np.concatenate(pending_values)
                whole = buffered // per_page * per_page
                flush(joined[:whole])
                pending_values = [joined[whole:]] if whole < buffered else []
            written += values.shape[0]
            shown.update(values.nbytes + scales.nbytes)
        if pending_values:
            flush(np.concatenate(pending_values))
        if written != header.rows:
            raise TableFormatError(f"{path}: wrote {written} rows, the header says {header.rows}")
        if separate:
            section = np.concatenate(scale_chunks).tobytes()
            out.write(section.ljust(-(-len(section) // PAGE) * PAGE, b"\0"))
        final = TableHeader(**{**header.__dict__, "scale_section_crc": scale_crc})
        out.seek(0)
        out.write(final.encode())
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    return final


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file of a checkpoint holds each tensor: the index's weight map, else the keys
    of model.safetensors (or, without it, of every *.safetensors file)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    files: dict[str, Path] = {}
    for path in [single] if single.exists() else sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), path))
    return files


def convert_checkpoint(model_dir: Path, out_dir: Path, scale_layout: str = "inline", progress: bool = True) -> list[Path]:
    """One table file per Engram layer of the V4.1 checkpoint in `model_dir` (its config.json's layout)."""
    spec = checkpoint_spec(model_dir)
    if spec is None:
        raise TableFormatError(f"{model_dir}: the checkpoint has no Engram layers")
    return convert_tables(model_dir, out_dir, spec.layout, scale_layout, progress)


def convert_tables(model_dir: Path, out_dir: Path, layout: EngramLayout, scale_layout: str = "inline",
                   progress: bool = True, layers: Collection[int] | None = None) -> list[Path]:
    """One table file per layer of `layout` (or only of `layers`) from the checkpoint's
    `model.engram_tables.<L>.weight` tensors, the layout's primes and offsets and the source tensors'
    digest (source.py) written into each header (build.py checks them)."""
    files = tensor_files(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    converting = [layer for layer in layout.layer_ids if layers is None or layer in layers]
    for index, layer in enumerate(layout.layer_ids):
        if layer not in converting:
            continue
        sources = source_tensors(files, layer, model_dir)
        name, *scale_names = sources
        scale_name = scale_names[0] if scale_names else None
        with safe_open(files[name], framework="pt") as values_file:
            values = values_file.get_slice(name)
            rows, dim = values.get_shape()
            value_dtype = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F32": "float32"}[values.get_dtype()]
            scale_handle = safe_open(files[scale_name], framework="pt") if scale_name else None
            scales = scale_handle.get_slice(scale_name) if scale_handle else None
            n_scales = scales.get_shape()[1] if scales is not None else 1
            header = layer_header(layout, index, rows, dim, value_dtype, n_scales, scale_layout,
                                  source_digest(files, sources))

            def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
                for start in range(0, rows, ROWS_PER_BLOCK):
                    end = min(rows, start + ROWS_PER_BLOCK)
                    block_scales = scales[start:end] if scales is not None else torch.ones(end - start, 1)
                    yield block_bytes(values[start:end], block_scales, header.scale_dtype)

            path = table_file(out_dir, layer)
            label = f"Engram table {converting.index(layer) + 1} of {len(converting)} (layer {layer})"
            write_table(path, header, blocks(), progress=progress, label=label)
            written.append(path)
    return written


def read_header(path: Path) -> TableHeader:
    with open(path, "rb") as f:
        return TableHeader.decode(f.read(PAGE), str(path))


def open_table(path: Path, digest: str) -> TableHeader:
    """The header of a table file that belongs to the checkpoint whose source tensors have digest
    `digest` (source.py) and is as long as its header implies. Raises StaleTableError for a
    file of another format version or other source tensors (reconverting replaces it), TableFormatError
    for a damaged one (bad header, truncated or extended); each names the file. Cheap: one page read."""
    header = read_header(path)
    if header.source_digest != digest:
        recorded = f"{header.source_digest[:24]}..." if header.source_digest else "none"
        raise StaleTableError(
            f"{path} was converted from other tensors than this checkpoint's model.engram_tables.{header.layer_id}"
            f" (source digest {recorded}, the checkpoint's {digest[:24]}...): a table of another checkpoint,"
            " or of these weights before they changed"
        )
    size = path.stat().st_size
    if size != header.file_bytes:
        raise TableFormatError(f"{path}: {size} bytes, its header implies {header.file_bytes} (truncated or damaged)")
    return header


def verify_table(path: Path) -> list[str]:
    """Every problem found in one file (empty: the file verifies)."""
    try:
        header = read_header(path)
    except TableFormatError as exc:
        return [str(exc)]
    problems = []
    size = path.stat().st_size
    if size != header.file_bytes:
        problems.append(f"{path}: {size} bytes, the header implies {header.file_bytes}")
    with open(path, "rb") as f:
        f.seek(PAGE)
        for page_no in range(1, header.data_pages + 1):
            page = f.read(PAGE)
            why = check_page(page, page_no, header.table_id)
            if why:
                problems.append(f"{path}: page {page_no}: {why}")
        if header.scale_layout == "separate":
            section = f.read(header.scale_section_bytes)
            if zlib.crc32(section) != header.scale_section_crc:
                problems.append(f"{path}: scale section checksum mismatch")
    return problems


def main_convert() -> None:
    parser = argparse.ArgumentParser(prog="python -m engram_store.convert", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, help="default: MODEL_DIR/engram")
    parser.add_argument("--scales", choices=["inline", "separate"], default="inline")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # progress lines when not on a terminal
    for path in convert_checkpoint(args.model_dir, args.out or args.model_dir / "engram", args.scales):
        print(json.dumps({"table": str(path), "bytes": path.stat().st_size}))


def main_verify() -> None:
    parser = argparse.ArgumentParser(prog="python -m engram_store.verify")
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    problems = [p for path in sorted(args.directory.glob("*.tbl")) for p in verify_table(path)]
    print("\n".join(problems) or "all pages verify")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main_convert()
