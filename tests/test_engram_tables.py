"""Engram table files are bound to the checkpoint they serve (issue 21, items 4 and 8): a table of
another checkpoint with the same layout, one converted before the weights were rewritten, or one of an
older format is refused at an explicit `engram.path` and reconverted at the default one; a truncated
file is refused at start; a failed read logs a line naming the file and page. Real files, the real
io_uring reader."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engram_store.build import EngramConfigError
from engram_store.convert import (
    convert_checkpoint,
    read_header,
    table_file,
    tensor_files,
    verify_table,
)
from engram_store.format import PAGE
from engram_store.source import SAMPLE_BYTES, SAMPLES, source_digest
from engram_store.store import EngramOptions
from models import load_model
from models.tiny import build_tiny_checkpoint
from tests.conftest import random_tokens
from tests.test_engram_store import disk_options, pages_of, run_requests

LAYERS = (1, 4)  # the tiny V4.1's Engram layers
PROMPTS = {"a": random_tokens(40, seed=5), "b": random_tokens(12, seed=6)}


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory) -> Path:
    """The tiny V4.1 again with other weights: the same config, so its tables have the same layout."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("other") / "v41", seed=1234, family="v41")


def own_copy(checkpoint: Path, where: Path) -> Path:
    """A copy of a checkpoint this test may rewrite (and whose default table directory it owns)."""
    return Path(shutil.copytree(checkpoint, where, ignore=shutil.ignore_patterns("engram")))


def default_disk() -> EngramOptions:
    """disk residency with `engram.path` unset: the tables live in MODEL_DIR/engram."""
    return EngramOptions(residency="disk", host_cache_bytes=1 << 14, queue_depth=8)


def rewrite_engram_rows(model_dir: Path, layer: int) -> None:
    """Rewrites the checkpoint's layer table with one row's values negated (fp8 sign bit), as a
    new training step or a fix to the weights would: same dtype, shape and layout."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    values = tensors[f"model.engram_tables.{layer}.weight"].view(torch.uint8).clone()
    values[3] ^= 0x80
    tensors[f"model.engram_tables.{layer}.weight"] = values.view(torch.float8_e4m3fn)
    save_file(tensors, str(path))


def spoil(fault: str, model_dir: Path, tables: Path, other: Path) -> list[Path]:
    """Leaves in `tables` table files that do not belong to `model_dir` as it now is; returns them."""
    if fault == "another checkpoint":
        convert_checkpoint(other, tables, progress=False)
        return [table_file(tables, layer) for layer in LAYERS]
    convert_checkpoint(model_dir, tables, progress=False)
    if fault == "weights rewritten":
        rewrite_engram_rows(model_dir, 4)
    else:  # a table written by the previous format version
        path = table_file(tables, 4)
        old = dataclasses.replace(read_header(path), version=1)
        with open(path, "r+b") as f:
            f.write(old.encode())
    return [table_file(tables, 4)]


FAULTS = ["another checkpoint", "weights rewritten", "old format"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_table_that_is_not_this_checkpoints_is_refused_at_an_explicit_path(fault, checkpoints, checkpoint_b,
                                                                               tmp_path):
    model_dir = own_copy(checkpoint_b, tmp_path / "model")
    tables = tmp_path / "tables"
    bad = spoil(fault, model_dir, tables, other=checkpoints["v41"])
    with pytest.raises(EngramConfigError) as refused:
        load_model(model_dir, engram=disk_options(tables))
    message = str(refused.value)
    assert message.startswith("engram.path: ") and str(bad[0]) in message
    assert f"python -m engram_store.convert {model_dir} --out {tables}" in message
    assert ("format version 1" if fault == "old format" else "converted from other tensors") in message


@pytest.mark.parametrize("fault", FAULTS)
def test_a_table_that_is_not_this_checkpoints_is_reconverted_at_the_default_path(fault, checkpoints, checkpoint_b,
                                                                                 tmp_path, caplog):
    model_dir = own_copy(checkpoint_b, tmp_path / "model")
    tables = model_dir / "engram"
    bad = spoil(fault, model_dir, tables, other=checkpoints["v41"])
    good = {path: read_header(path).table_id for path in tables.glob("*.tbl") if path not in bad}
    expected, _ = run_requests(load_model(model_dir, engram=EngramOptions(residency="host")), PROMPTS)
    caplog.set_level(logging.WARNING, logger="ds4serve.engram")
    model = load_model(model_dir, engram=default_disk())
    warnings = [r.getMessage() for r in caplog.records if r.name == "ds4serve.engram" and r.levelno == logging.WARNING]
    assert len(warnings) == len(bad) and all(str(path) in line for path, line in zip(bad, warnings))
    assert all("reconverting it" in line for line in warnings)
    tokens, errors = run_requests(model, PROMPTS)
    assert tokens == expected and not errors  # this checkpoint's exact tokens
    assert all(verify_table(path) == [] for path in tables.glob("*.tbl"))
    assert {path: read_header(path).table_id for path in good} == good  # the sound table was kept


def test_the_two_checkpoints_differ_where_the_binding_looks(checkpoints, checkpoint_b):
    """The foreign-table cases above mean something: same layout, other tokens, other digests."""
    a, b = checkpoints["v41"], checkpoint_b
    assert read_shapes(a) == read_shapes(b)
    tokens_a, _ = run_requests(load_model(a, engram=EngramOptions(residency="host")), PROMPTS)
    tokens_b, _ = run_requests(load_model(b, engram=EngramOptions(residency="host")), PROMPTS)
    assert tokens_a != tokens_b
    names = ["model.engram_tables.1.weight", "model.engram_tables.1.weight_scale_inv"]
    assert source_digest(tensor_files(a), names) != source_digest(tensor_files(b), names)


def read_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in load_file(str(model_dir / "model.safetensors")).items()
            if name.startswith("model.engram_tables.")}


@pytest.mark.parametrize("explicit", [True, False])
def test_a_truncated_table_is_refused_at_start_naming_the_file(explicit, checkpoint_b, tmp_path):
    model_dir = own_copy(checkpoint_b, tmp_path / "model")
    tables = tmp_path / "tables" if explicit else model_dir / "engram"
    convert_checkpoint(model_dir, tables, progress=False)
    path = table_file(tables, 4)
    size = path.stat().st_size
    os.truncate(path, size - PAGE)
    with pytest.raises(EngramConfigError) as refused:
        load_model(model_dir, engram=disk_options(tables) if explicit else default_disk())
    assert f"engram.path: {path}: {size - PAGE} bytes, its header implies {size}" in str(refused.value)
    assert path.stat().st_size == size - PAGE  # refused, not silently replaced


def test_a_failed_read_logs_one_line_naming_the_file_and_page(checkpoints, tmp_path, caplog):
    tables = tmp_path / "tables"
    model = load_model(checkpoints["v41"], engram=disk_options(tables))
    bad = min(pages_of(model, PROMPTS["a"], 0))
    path = table_file(tables, LAYERS[0])
    with open(path, "r+b") as f:  # the disk goes bad after start: a flipped byte in a data page
        f.seek(bad * PAGE + 10)
        byte = f.read(1)
        f.seek(bad * PAGE + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.WARNING, logger="ds4serve.engram")
    _, errors = run_requests(model, {"a": PROMPTS["a"]})
    assert "a" in errors
    store = model.engram_memory.source
    row = (bad - 1) * store.layers[0].header.rows_per_page
    step = store.start({0: torch.tensor([[row]])})  # the page fails again: counted, not logged again
    store.rows(step, 0)
    assert list(step.failed) == [0]
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4serve.engram"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Engram read failed: {path} page {bad}: checksum mismatch")
    assert store.stats.current.read_errors >= 2


def test_the_digest_of_a_large_tensor_samples_it_and_still_tells_checkpoints_apart(tmp_path):
    """Above SAMPLES x SAMPLE_BYTES a tensor is sampled: another tensor of the same shape, or a change
    in a sampled block (the last one here), changes the digest; a change between samples does not
    (the trade-off source.py documents)."""
    nbytes = SAMPLES * SAMPLE_BYTES + (16 << 20)
    name = "model.engram_tables.1.weight"
    files = {}
    for seed in (0, 1):
        values = np.random.default_rng(seed).integers(0, 256, size=(nbytes // 1024, 1024), dtype=np.uint8)
        files[seed] = tmp_path / f"{seed}.safetensors"
        save_file({name: torch.from_numpy(values)}, str(files[seed]))
    digest = source_digest({name: files[0]}, [name])
    assert digest != source_digest({name: files[1]}, [name])

    def flip(offset: int) -> str:
        with open(files[0], "r+b") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
            f.seek(data_start + offset)
            byte = f.read(1)
            f.seek(data_start + offset)
            f.write(bytes([byte[0] ^ 1]))
        return source_digest({name: files[0]}, [name])

    assert flip(SAMPLE_BYTES + 100) == digest  # between the first two samples
    assert flip(nbytes - 1) != digest
