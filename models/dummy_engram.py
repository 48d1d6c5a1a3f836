"""Seeded random Engram tables of the configured size, for dummy weights (`model.load_format: dummy`).

Rows are drawn in blocks of BLOCK_ROWS, each block from its own generator seeded from (seed, layer,
block), so a run of rows is the same bytes whoever draws it: a tensor-parallel rank's share, a whole
table held in RAM or on the device, or a table file of the disk tier. Rows are in the release's format:
fp8 e4m3 values with one power-of-two scale per 32 channels (models/tiny.py `quantize_engram_rows`).

The disk tier reads real files through io_uring, so for it the tables are written once, as table files
(engram_store/format.py), into engram.path (default MODEL_DIR/engram, as converted tables). Each header
records `digest(layer)`: the drawing rule's version, the seed, the layer, the table's shape and the
generator's device type. A file of another seed or size is drawn again at the default path and refused
at an explicit one, as a converted table of another checkpoint is (engram_store/build.py).
Drawing runs on the compute device when it is a GPU (a released V4.1-Flash table is ~94 GiB).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engram_store.convert import block_bytes, layer_header, table_file, write_table
from engram_store.hashing import EngramLayout
from engram_store.spec import EngramSpec
from models.engram_setup import TableRows
from models.random_model import seeded
from models.tiny import quantize_engram_rows

BLOCK_ROWS = 1 << 16
VERSION = 1  # of the drawing rule: a change makes every written file stale
SCALE_BLOCK = 32


@dataclass(frozen=True)
class DummyTables:
    """The Engram tables of `spec`'s layers drawn from `seed` on `device` (engram_store.build.TableSource
    for the disk tier, `read_table` for the loader's in-memory tiers)."""

    spec: EngramSpec
    seed: int
    default_dir: Path  # MODEL_DIR/engram
    device: str = "cpu"

    def table_rows(self, layer: int) -> int:
        return self.spec.layout.num_embeddings[self.spec.layer_ids.index(layer)]

    def rows(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, end) of `layer`'s table on the CPU: fp8 values [n, head_dim] and float32 scales
        [n, head_dim / 32], filled a block at a time (no second copy of a table held whole)."""
        values = torch.empty((end - start, self.spec.head_dim), dtype=torch.float8_e4m3fn)
        scales = torch.empty((end - start, self.spec.head_dim // SCALE_BLOCK), dtype=torch.float32)
        for block in range(start // BLOCK_ROWS, -(-end // BLOCK_ROWS)):
            block_values, block_scales = self._block(layer, block)
            first = block * BLOCK_ROWS
            low, high = max(start, first), min(end, first + len(block_values))
            values[low - start : high - start] = block_values[low - first : high - first]
            scales[low - start : high - start] = block_scales[low - first : high - first]
        return values, scales

    def read_table(self, rows: TableRows, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """models/engram_setup.py's TableReader: (values, scales, rows the whole table has)."""
        assert head_dim == self.spec.head_dim
        return (*self.rows(rows.layer, rows.start, rows.end), self.table_rows(rows.layer))

    def digest(self, layer: int) -> str:
        shape = f"{self.table_rows(layer)}x{self.spec.head_dim}"
        key = f"{VERSION}/{self.seed}/{layer}/{shape}/{torch.device(self.device).type}"
        return f"dummy-blake2b-256:{hashlib.blake2b(key.encode(), digest_size=32).hexdigest()}"

    def write(self, out_dir: Path, layout: EngramLayout, scale_layout: str, layers: Collection[int]) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for number, layer in enumerate(sorted(layers)):
            index, rows = layout.layer_ids.index(layer), self.table_rows(layer)
            header = layer_header(layout, index, rows, self.spec.head_dim, "float8_e4m3fn",
                                  self.spec.head_dim // SCALE_BLOCK, scale_layout, self.digest(layer))
            label = f"dummy Engram table {number + 1} of {len(layers)} (layer {layer}, seed {self.seed})"
            write_table(table_file(out_dir, layer), header, self._file_blocks(layer, rows, header.scale_dtype),
                        progress=True, label=label)

    def remedy(self, out_dir: Path, scale_layout: str) -> str:
        return (f"delete the table files in {out_dir} (dummy tables are drawn there from model.seed {self.seed} on"
                " first start), or point engram.path elsewhere")

    def _file_blocks(self, layer: int, rows: int, scale_dtype: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for block in range(-(-rows // BLOCK_ROWS)):
            yield block_bytes(*self._block(layer, block), scale_dtype)

    def _block(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `block` of `layer`'s rows (the last one may be short), on the CPU."""
        count = min(BLOCK_ROWS, self.table_rows(layer) - block * BLOCK_ROWS)
        generator = seeded(self.device, self.seed, f"model.engram_tables.{layer}", block)
        dense = torch.randn((count, self.spec.head_dim), generator=generator, device=self.device)
        values, scales = quantize_engram_rows(dense)
        return values.cpu(), scales.cpu()
