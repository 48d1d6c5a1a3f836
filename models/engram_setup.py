"""Builds a V4.1 checkpoint's Engram memory: the hasher from its tokenizer, the tables from its files.

Checked here rather than trusted: the tokenizer-derived compressed vocabulary must equal the config's
`engram_compressed_vocab_size`, and each table must hold exactly as many rows as its layout's primes
add up to (a table of another layout would hash into the wrong rows without any error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from engram_store import InMemoryEngramTable
from engram_store.build import build_store
from engram_store.store import EngramOptions
from models.config import ConfigError
from models.config_v41 import EngramSpec
from models.engram import EngramMemory
from models.engram_hash import EngramLayout, NgramHasher, build_compressed_token_map

TableReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def engram_hasher(spec: EngramSpec, tokenizer: Tokenizer) -> NgramHasher:
    lookup = build_compressed_token_map(tokenizer)
    compressed = max(lookup) + 1
    if spec.compressed_vocab_size is not None and compressed != spec.compressed_vocab_size:
        raise ConfigError(
            f"engram_compressed_vocab_size is {spec.compressed_vocab_size} but the tokenizer compresses to {compressed}"
        )
    if not 0 <= spec.pad_id < len(lookup):
        raise ConfigError(f"engram_pad_id {spec.pad_id} is not a token id of the tokenizer ({len(lookup)} ids)")
    layout = EngramLayout.build(list(spec.layer_ids), spec.max_ngram, spec.n_heads, spec.prime_search_start)
    for layer, rows, configured in zip(spec.layer_ids, layout.num_embeddings, spec.num_embeddings):
        if configured and configured != rows:
            raise ConfigError(f"engram_num_embeddings for layer {layer} is {configured}, the layout needs {rows} rows")
    return NgramHasher(lookup, layout, spec.pad_id)


def engram_memory(
    spec: EngramSpec, directory: Path, read_table: TableReader, device: str, options: EngramOptions | None = None
) -> EngramMemory:
    """Without `options` every table is read into memory; with them, each layer goes to its tier."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ConfigError(f"Engram needs the checkpoint's tokenizer: {tokenizer_file} is missing")
    hasher = engram_hasher(spec, Tokenizer.from_file(str(tokenizer_file)))
    if options is not None:
        primes = [[p for order in layer for p in order] for layer in hasher.layout.primes]
        store = build_store(spec.layer_ids, hasher.layout.num_embeddings, primes, spec.head_dim, directory, read_table,
                            options, device)
        return EngramMemory(hasher, store)
    values, scales = [], []
    for layer, rows in zip(spec.layer_ids, hasher.layout.num_embeddings):
        layer_values, layer_scales = read_table(layer, spec.head_dim)
        if layer_values.shape[0] != rows:
            raise ConfigError(f"model.engram_tables.{layer}.weight has {layer_values.shape[0]} rows, the layout needs {rows}")
        values.append(layer_values.to(device))
        scales.append(layer_scales.to(device))
    return EngramMemory(hasher, InMemoryEngramTable(values, scales))
