"""What a model directory must hold for its load format, and where the tokenizer comes from.

The front end checks the directory before anything starts (server/launch.py), so a missing file is a
config error naming it, not an engine process's traceback; the front end and the engine find the
tokenizer the same way (`tokenizer_dir`). Standard library only: the HTTP front end imports it.

- `model.load_format: auto`: config.json and the weights (*.safetensors, or an index of shards);
- `model.load_format: dummy`: config.json alone; the weights are drawn (models/dummy_weights.py);
- the tokenizer (tokenizer.json, and tokenizer_config.json for the chat template): `model.tokenizer`
  (vLLM's --tokenizer) when given, else the model directory's. A dummy directory without one borrows
  the embedded default's (default_model/), which the engine accepts only when its vocabulary is the
  model's, every id one way and the other (engine/factory.py `check_tokenizer`).

The embedded default (no model.path) ships in the repository, so nothing builds it: a checkout that
lacks its files is refused here like any other directory, naming it.
"""

from __future__ import annotations

from pathlib import Path

from contract.config import DEFAULT_MODEL_DIR, ConfigFileError, ServeConfig

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
MODEL_FLAG = "model.path (MODEL / --model)"


def borrows_default_tokenizer(config: ServeConfig) -> bool:
    """Dummy weights in a directory without a tokenizer, and no model.tokenizer: the default's is used."""
    return (config.model.tokenizer is None and config.model.load_format == "dummy"
            and not (config.model_dir / TOKENIZER).exists())


def tokenizer_dir(config: ServeConfig) -> Path:
    """The directory tokenizer.json (and tokenizer_config.json) are read from."""
    if config.model.tokenizer is not None:
        return Path(config.model.tokenizer)
    return DEFAULT_MODEL_DIR if borrows_default_tokenizer(config) else config.model_dir


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors.index.json").exists() or any(model_dir.glob("*.safetensors"))


def check_model_dir(config: ServeConfig) -> None:
    """Raises ConfigFileError, naming the key and what is missing, for a directory that cannot serve
    with this load format, the embedded default's (no model.path) included."""
    model_dir = config.model_dir
    if config.model.path is None:
        check_default_model(config)
    else:
        if not model_dir.is_dir():
            raise ConfigFileError(
                f"{MODEL_FLAG} {config.model.path}: no such directory; this server serves a local checkpoint (a"
                f" Hugging Face id must be downloaded first: huggingface-cli download {config.model.path} --local-dir"
                " DIR)")
        if not (model_dir / CONFIG).is_file():
            raise ConfigFileError(
                f"{MODEL_FLAG} {model_dir}: no {CONFIG}; a model directory holds config.json, the weights"
                " (*.safetensors) and tokenizer.json (with --load-format dummy, config.json and a tokenizer are"
                " enough)")
        if config.model.load_format == "auto" and not has_weights(model_dir):
            raise ConfigFileError(
                f"{MODEL_FLAG} {model_dir}: {CONFIG} but no weights (*.safetensors); to serve seeded random weights"
                " at its dims, add --load-format dummy (model.load_format: dummy)")
    if config.model.tokenizer is not None:
        if not (Path(config.model.tokenizer) / TOKENIZER).is_file():
            raise ConfigFileError(f"model.tokenizer (--tokenizer) {config.model.tokenizer}: no {TOKENIZER} there")
    elif config.model.path is not None and not borrows_default_tokenizer(config):
        if not (model_dir / TOKENIZER).is_file():
            raise ConfigFileError(f"{MODEL_FLAG} {model_dir}: no {TOKENIZER}; give the tokenizer's directory with"
                                  " --tokenizer DIR (model.tokenizer)")


def check_default_model(config: ServeConfig) -> None:
    """The embedded default (default_model/) is tracked in git: a checkout without its files is broken."""
    model_dir = config.model_dir
    wanted = {
        CONFIG: (model_dir / CONFIG).is_file(),
        "*.safetensors": config.model.load_format == "dummy" or has_weights(model_dir),
        TOKENIZER: config.model.tokenizer is not None or (model_dir / TOKENIZER).is_file(),
    }
    missing = [name for name, present in wanted.items() if not present]
    if missing:
        raise ConfigFileError(
            f"model.path is unset, so the embedded default {model_dir} is served, but it has no {', '.join(missing)};"
            " it ships with the repository, so this checkout is incomplete (restore it: git checkout -- default_model),"
            f" or give a checkpoint with {MODEL_FLAG}")
