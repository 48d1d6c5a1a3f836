"""Dummy weights (`model.load_format: dummy`, vLLM's `--load-format dummy`): a served model whose
weights are seeded random numbers at the dims of a directory that holds only config.json (and a
tokenizer), so every figure the server reports can be measured at real dims without a checkpoint.

What `load_model` is for a checkpoint, `build_dummy_model` is for such a directory: the same model
class at this rank's shard sizes, drawn in place on the device (models/random_model.py: per-parameter
seeds, so every tensor-parallel world size holds the same model), in the serving dtype or, with
`released`, in the release's formats as `model.quantization: checkpoint` holds a released checkpoint
(models/released_format.py, from config.json's quantization_config); V4.1's Engram tables of the
configured size in their tiers (models/dummy_engram.py). Nothing is read but config.json and the
tokenizer; the same seed on the same device type gives the same weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from contract.progress import Progress
from engram_store.store import EngramOptions
from models.config import ConfigError, ModelConfig
from models.dummy_engram import DummyTables
from models.engram_setup import engram_memory
from models.loader import CheckpointError, ExpertsLoaded, loaded_dtype
from models.model import DeepseekV4
from models.model_v41 import DeepseekV41
from models.parallel import SINGLE, TensorParallel
from models.random_model import draw_weights, meta_model
from models.released_format import ReleasedFormat

log = logging.getLogger("ds4serve.models")


def build_dummy_model(
    directory: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    released: bool = False,
    engram: EngramOptions | None = None,
    tp: TensorParallel = SINGLE,
    tokenizer_dir: Path | None = None,
    mtp: bool = False,
    experts_loaded: ExpertsLoaded | None = None,
) -> DeepseekV4 | DeepseekV41:
    """The model of `directory`/config.json with weights drawn from `seed` on `device` (see the module
    docstring); `engram`, `tp`, `tokenizer_dir`, `mtp` and `experts_loaded` as load_model takes them."""
    directory = Path(directory)
    config_json = directory / "config.json"
    config = ModelConfig.from_file(config_json)
    try:
        model = meta_model(config, tp, mtp)
    except ConfigError as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc
    fmt = ReleasedFormat.of(config_json) if released else None
    total = _dense_bytes(model, dtype) if fmt is None else None  # packed sizes are not known before the draw
    what = "the release's formats" if fmt is not None else str(dtype).removeprefix("torch.")
    with Progress(f"drawing dummy weights (seed {seed}, {what})", total, log, enabled=tp.rank == 0) as progress:
        draw_weights(model, seed, dtype, device, fmt, progress, experts_loaded)
    if config.engram is not None:
        tables = DummyTables(config.engram, seed, directory / "engram", device)
        try:
            model.engram_memory = engram_memory(config.engram, directory, tables.read_table, device, engram, tp,
                                                tables=tables, tokenizer_dir=tokenizer_dir)
        except ConfigError as exc:
            raise CheckpointError(f"{directory}: {exc}") from exc
    log.info("%s: rank %d of %d holds dummy weights (seed %d, %s)", directory, tp.rank, tp.world_size, seed, what)
    return model.eval()


def _dense_bytes(model: DeepseekV4 | DeepseekV41, dtype: torch.dtype) -> int:
    """Bytes the unquantized draw will hold (a tied head is the embedding)."""
    tied = model.config.tie_word_embeddings
    tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if not (tied and n == "lm_head.weight")]
    return sum(t.numel() * loaded_dtype(n, dtype, t.dtype).itemsize for n, t in tensors)
