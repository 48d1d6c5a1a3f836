"""The embedded default, default_model/ (the trained tiny V4.1, tools/train_tiny.py): served when no model
is given, its greedy tokens (plain, and with its MTP head drafting) are its own forward's argmax, its weights
are trained (held-out stdlib text costs far fewer nats than any unigram, and than random weights at its
dims), and a checkout without it is refused naming the directory."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from contract.config import DEFAULT_MODEL_DIR, ConfigFileError, load_config
from contract.model_files import check_model_dir
from models import ForwardBatch, ModelCache, load_model
from models.dummy_weights import build_dummy_model
from tests.serving import running_server, settled_metrics
from tools.stdlib_corpus import split, stdlib_files

BOS = 0
CARD = json.loads((DEFAULT_MODEL_DIR / "training_card.json").read_text())


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL_DIR, dtype=torch.float32)  # configs/cpu-tiny.yaml serves it in float32


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, 1, len(ids))
    with torch.inference_mode():
        return model(ForwardBatch.build([(0, ids, 0)], logits="all"), cache)


def test_the_shipped_files_are_the_carded_model():
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size == CARD["safetensors_bytes"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        path.name for path in DEFAULT_MODEL_DIR.iterdir()}


def greedy_is_the_argmax(base: str, model, tokenizer) -> None:
    """Every greedy token (24 of each prompt, EOS ignored) is within 1e-4 of the maximum of the model's own
    teacher-forced logits over prompt + generated."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].root == str(DEFAULT_MODEL_DIR)
    for text in ("def ", "import os\n"):
        prompt = [BOS] + tokenizer.encode(text, add_special_tokens=False).ids
        response = client.completions.create(
            model="ds4-tiny", prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        generated = response.choices[0].token_ids
        assert len(generated) == 24 and response.choices[0].finish_reason == "length"
        logits = teacher_forced(model, prompt + generated)
        for step, token in enumerate(generated):
            row = logits[len(prompt) - 1 + step]
            assert row[token] >= row.max() - 1e-4, f"{text!r} token {step}: {token} is not the argmax"


def test_without_a_model_the_server_serves_the_default_and_greedy_is_its_argmax(model, tokenizer):
    """No --model: configs/cpu-tiny.yaml's default (float32 on the CPU)."""
    with running_server(None, "ds4-tiny") as base:
        greedy_is_the_argmax(base, model, tokenizer)


def test_the_defaults_mtp_head_drafts_and_greedy_stays_its_argmax(model, tokenizer):
    """The default ships an MTP layer: --speculative-config mtp serves, some drafts are accepted (the card:
    53% agreement with the target), and the tokens are still the target's argmax."""
    config = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    with running_server(None, "ds4-tiny", "--speculative-config", config) as base:
        greedy_is_the_argmax(base, model, tokenizer)
        drafts, accepted = settled_metrics(base, "vllm:spec_decode_num_draft_tokens_total",
                                           "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts, (drafts, accepted)


def window_loss(model, windows: list[list[int]]) -> float:
    """Mean next-token loss (nats) over BOS + each window, every token after BOS predicted, as
    tools/train_tiny.py's held_out_loss measures it."""
    sequences = [[BOS] + w for w in windows]
    cache = ModelCache.allocate(model.config, len(sequences), max(map(len, sequences)))
    rows = [list(range(len(s) - 1)) for s in sequences]
    with torch.inference_mode():
        logits = model(ForwardBatch.build([(i, s, 0) for i, s in enumerate(sequences)], logits=rows), cache)
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    return F.cross_entropy(logits.float(), targets).item()


def test_the_shipped_weights_are_trained(model, tokenizer):
    """Two 256-token windows of a held-out module (never trained on): the loss is below the entropy of
    those tokens' own unigram (the best any unigram could do on them), and far below random weights at
    the same dims (~ln 4096 = 8.3 nats and above)."""
    _, held_out = split(stdlib_files())
    source = next(f for f in held_out if f.module == "textwrap")
    ids = tokenizer.encode(source.text(), add_special_tokens=False).ids
    windows = [ids[i * 255 : (i + 1) * 255] for i in range(2)]
    assert all(len(w) == 255 for w in windows)
    counts = np.bincount([t for w in windows for t in w], minlength=model.config.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())
    trained = window_loss(model, windows)
    assert trained < min(unigram_entropy, 6.0), (trained, unigram_entropy)
    random = build_dummy_model(DEFAULT_MODEL_DIR, 0, tokenizer_dir=DEFAULT_MODEL_DIR)
    assert window_loss(random, windows) > trained + 2.5


def test_a_checkout_without_the_default_is_refused_naming_its_directory(tmp_path, monkeypatch):
    missing = tmp_path / "default_model"
    monkeypatch.setattr("contract.config.DEFAULT_MODEL_DIR", missing)
    config = load_config(None, [])
    assert config.model.path is None and config.model_dir == missing
    with pytest.raises(ConfigFileError, match=rf"embedded default {missing} .*no config.json, \*.safetensors, "
                                              r"tokenizer.json.*git checkout -- default_model"):
        check_model_dir(config)
    missing.mkdir()
    (missing / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    (missing / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigFileError, match=r"has no \*.safetensors;"):
        check_model_dir(config)
    check_model_dir(load_config(None, ["model.load_format=dummy"]))  # dummy weights need none
