"""Builds a V4.1 checkpoint's Engram memory: the hasher from its tokenizer, the tables from its files.

Checked here rather than trusted: the tokenizer-derived compressed vocabulary must equal the config's
`engram_compressed_vocab_size`, and each table must hold exactly as many rows as its layout's primes
add up to (a table of another layout would hash into the wrong rows without any error).

Under tensor parallelism each rank reads only its hash heads' rows (engram.py says why): a
contiguous run of each table, because a layer's columns are laid out back to back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from engram_store import InMemoryEngramTable
from engram_store.build import RESIDENCIES, TableSource, build_store
from engram_store.hashing import NgramHasher, build_compressed_token_map
from engram_store.spec import EngramSpec
from engram_store.store import EngramOptions
from models.config import ConfigError
from models.engram import EngramMemory, EngramShard
from models.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class TableRows:
    """Rows [start, end) of Engram layer `layer`'s table, the part one rank reads."""

    layer: int
    start: int
    end: int


# (rows, head_dim) -> (values [end - start, head_dim], scales [end - start, head_dim / block], rows stored)
TableReader = Callable[[TableRows, int], tuple[torch.Tensor, torch.Tensor, int]]


def engram_hasher(spec: EngramSpec, tokenizer: Tokenizer) -> NgramHasher:
    lookup = build_compressed_token_map(tokenizer)
    compressed = max(lookup) + 1
    if spec.compressed_vocab_size is not None and compressed != spec.compressed_vocab_size:
        raise ConfigError(
            f"engram_compressed_vocab_size is {spec.compressed_vocab_size} but the tokenizer compresses to {compressed}"
        )
    if not 0 <= spec.pad_id < len(lookup):
        raise ConfigError(f"engram_pad_id {spec.pad_id} is not a token id of the tokenizer ({len(lookup)} ids)")
    for layer, rows, configured in zip(spec.layer_ids, spec.layout.num_embeddings, spec.num_embeddings):
        if configured and configured != rows:
            raise ConfigError(f"engram_num_embeddings for layer {layer} is {configured}, the layout needs {rows} rows")
    return NgramHasher(lookup, spec.layout, spec.pad_id)


def engram_memory(
    spec: EngramSpec, directory: Path, read_table: TableReader, device: str, options: EngramOptions | None = None,
    tp: TensorParallel = SINGLE, tables: TableSource | None = None, tokenizer_dir: Path | None = None,
) -> EngramMemory:
    """Without `options` every table (this rank's rows of it) is read into memory; with them, each layer
    goes to its tier (a disk tier reads the shared table file by whole-table row id, written by `tables`:
    default, converted from the checkpoint in `directory`). The hasher comes from the tokenizer in
    `tokenizer_dir` (default `directory`)."""
    tokenizer_file = (tokenizer_dir or directory) / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ConfigError(f"Engram needs the checkpoint's tokenizer: {tokenizer_file} is missing")
    hasher = engram_hasher(spec, Tokenizer.from_file(str(tokenizer_file)))
    layout = hasher.layout
    columns = tp.shard("the Engram hash heads ((engram_max_ngram_size - 1) x engram_n_heads)", spec.n_columns)
    first, end = columns.start, columns.start + columns.size
    wanted = {
        layer: TableRows(layer, offsets[first], offsets[end] if end < len(offsets) else rows)
        for layer, offsets, rows in zip(spec.layer_ids, layout.offsets, layout.num_embeddings)
    }

    def read_layer(layer: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, scales, stored = read_table(wanted[layer], head_dim)
        needed = layout.num_embeddings[spec.layer_ids.index(layer)]
        if stored != needed:
            raise ConfigError(f"model.engram_tables.{layer}.weight has {stored} rows, the layout needs {needed}")
        return values, scales

    def shard(in_memory: list[bool]) -> EngramShard | None:
        if columns.whole:
            return None
        shifts = tuple(-wanted[layer].start if held else 0 for layer, held in zip(spec.layer_ids, in_memory))
        return EngramShard(first, end, shifts)

    if options is not None:
        store = build_store(layout, spec.head_dim, directory, read_layer, options, device, tables)
        in_memory = [not RESIDENCIES[options.residency_of(layer)].reads_files for layer in spec.layer_ids]
        return EngramMemory(hasher, store, shard(in_memory))
    values, scales = [], []
    for layer in spec.layer_ids:
        layer_values, layer_scales = read_layer(layer, spec.head_dim)
        values.append(layer_values.to(device))
        scales.append(layer_scales.to(device))
    return EngramMemory(hasher, InMemoryEngramTable(values, scales), shard([True] * len(spec.layer_ids)))
