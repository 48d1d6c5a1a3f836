"""What an Engram table file was converted from: a digest of the checkpoint tensors it copies.

A table file (format.py) is a copy of one layer's `model.engram_tables.<L>.weight` and its scales. Two
checkpoints with the same config have tables of the same layout, so a shape check cannot tell their
files apart, and neither can it tell a table converted before the weights were rewritten. The converter
therefore records `source_digest(...)` of the source tensors in the header, and the builder recomputes
it from the checkpoint on every open: a table whose digest differs is foreign or stale, and is
reconverted (default `engram.path`) or refused at start (an explicit one).

The digest (BLAKE2b-256) covers, for the values tensor and then its scale tensor, the name, dtype and
shape from the safetensors header, and the tensor's bytes: all of them when the tensor is at most
SAMPLES x SAMPLE_BYTES (64 MiB), else SAMPLES blocks of SAMPLE_BYTES evenly spaced from its first byte
to its last. So an open reads at most 64 MiB per tensor whatever the table size.

The trade-off: hashing a released table (~98 GB) in full on every start would cost minutes of reads;
the sample costs well under a second on NVMe. Another checkpoint (another seed, training run or release)
differs in every block, so it is caught; so is any rewrite that changes a dtype, a shape or any sampled
block. What sampling can miss is an in-place edit of a few rows of a tensor above 64 MiB that falls
between samples (~1 in 1,500 of the bytes of a 98 GB table are read): reconvert by hand after such an
edit. Tensors up to 64 MiB (small tables, the tiny test checkpoints) are hashed whole, so any change to
them is caught. Where a tensor sits (its shard file, its offsets there) is deliberately not hashed:
resharding a checkpoint leaves the table's contents as they were and should not cost a reconversion.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from engram_store.format import TableFormatError

SAMPLES = 1024
SAMPLE_BYTES = 64 << 10


def source_tensors(files: Mapping[str, Path], layer: int, model_dir: Path) -> list[str]:
    """The tensors a layer's table is converted from: its values, then its scales if it has any.
    `files`: which safetensors file of the checkpoint in `model_dir` holds each tensor (convert.tensor_files)."""
    name = f"model.engram_tables.{layer}.weight"
    if name not in files:
        raise TableFormatError(f"{model_dir}: no tensor {name} in the checkpoint's safetensors files")
    scales = [n for n in (name + "_scale_inv", f"model.engram_tables.{layer}.scale") if n in files]
    return [name, *scales[:1]]


def source_digest(files: Mapping[str, Path], names: Sequence[str]) -> str:
    """The digest of tensors `names` (see the module docstring for what it covers and why)."""
    digest = hashlib.blake2b(digest_size=32)
    for name in names:
        path = files[name]
        with open(path, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            entry = json.loads(f.read(header_bytes))[name]
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
            for offset, size in _spans(end - begin):
                f.seek(8 + header_bytes + begin + offset)
                digest.update(f.read(size))
    return f"blake2b-256:{digest.hexdigest()}"


def _spans(nbytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the bytes hashed of a tensor of `nbytes` bytes: all, or the evenly spaced
    samples (the first and the last block among them)."""
    if nbytes <= SAMPLES * SAMPLE_BYTES:
        return [(offset, min(SAMPLE_BYTES, nbytes - offset)) for offset in range(0, nbytes, SAMPLE_BYTES)]
    return [((nbytes - SAMPLE_BYTES) * i // (SAMPLES - 1), SAMPLE_BYTES) for i in range(SAMPLES)]
