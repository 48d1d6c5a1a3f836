"""tools/train_tiny.py: the training forward is the serving forward (same logits, bit for bit here), its
gradients reach every parameter group (the indexers through their own loss only), a few steps lower the
loss, the saved checkpoint loads with the serving loader and answers, and the recall task is seeded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from models import ForwardBatch, ModelCache, ModelConfig, load_model
from tools.needle import NeedleTask, answer_matches, greedy_generate, needle_accuracy, packed
from tools.stdlib_corpus import EXCLUDED_DIRS, EXCLUDED_TOP, HELD_OUT, load_tokenizer, split, stdlib_files, stdlib_root
from tools.train_tiny import BOS, EOS, build, main, parse_args, save_checkpoint, space_splits
from tools.tiny_training import IGNORE, TrainingSequence, _shifted, parameter_groups, round_to_stored

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def tiny_trainer(tokenizer, seed: int = 0):
    """The CI dims (models/tiny.py's) with the shipped tokenizer, every part built as a run builds it."""
    args = parse_args(["--out", "unused", "--device", "cpu", "--preset", "test", "--seed", str(seed),
                       "--indexer-queries", "16"])
    raw, trainer = build(args, tokenizer, torch.device("cpu"))
    return raw, trainer


def sequences(n_tokens: list[int], seed: int = 0) -> list[TrainingSequence]:
    generator = torch.Generator().manual_seed(seed)
    return [TrainingSequence([BOS] + torch.randint(7, 4096, (n - 1,), generator=generator).tolist(), (n // 2,))
            for n in n_tokens]


def serving_logits(model, seqs: list[TrainingSequence]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, len(seqs), max(len(s.tokens) for s in seqs))
    return model(ForwardBatch.build([(i, s.tokens, 0) for i, s in enumerate(seqs)], logits="all"), cache)


def training_logits(model, seqs: list[TrainingSequence]) -> torch.Tensor:
    cache = ModelCache.allocate(model.config, len(seqs), max(len(s.tokens) for s in seqs))
    batch = ForwardBatch.build([(i, s.tokens, 0) for i, s in enumerate(seqs)]).with_pages(cache.default_pages)
    return model.head(*model.residual_streams(batch, cache)).float()


def test_training_forward_equals_the_serving_forward(tokenizer, tmp_path):
    """Same weights, same tokens: the differentiable forward (straight-through rounding, trainable
    Engram tables) gives the serving forward's logits, and so does the checkpoint it saves, loaded as
    the server loads it (fp8 Engram tables, float32 weights). The sequences pass the window (16) and the
    top-k (8), so sparse selection, both kv sources and the candidate blocks are all in play."""
    raw, trainer = tiny_trainer(tokenizer)
    model = trainer.model.eval()
    seqs = sequences([150, 97])
    trained = training_logits(model, seqs)
    assert trained.requires_grad
    served = serving_logits(model, seqs)
    torch.testing.assert_close(trained.detach(), served, rtol=1e-5, atol=1e-5)  # equal bits on CPU
    save_checkpoint(tmp_path, raw, trainer, tokenizer, torch.float32)
    loaded = load_model(tmp_path)
    torch.testing.assert_close(serving_logits(loaded, seqs), served, rtol=1e-5, atol=1e-5)


def grads(trainer, loss: torch.Tensor) -> set[str]:
    """Names of the parameters `loss` gives a non-zero gradient."""
    for module in trainer.modules().values():
        module.zero_grad(set_to_none=True)
    loss.backward()
    return {prefix + name for prefix, module in trainer.modules().items() for name, p in module.named_parameters()
            if p.grad is not None and bool(p.grad.any())}


def test_gradients_reach_every_parameter_group(tokenizer):
    """The language-model loss reaches everything but the lightning indexers (behind a hard top-k) and
    the MTP head (its own loss); the indexers' KL term reaches exactly their projections; together,
    every parameter, the Engram tables and the compressors (through the cache) included."""
    _, trainer = tiny_trainer(tokenizer)
    seqs = sequences([120, 80])
    every = {prefix + name for prefix, m in trainer.modules().items() for name, _ in m.named_parameters()}
    indexers = {n for n in every if ".indexer." in n}
    mtp = {n for n in every if n.startswith("mtp.0.")}
    assert indexers and mtp and {"engram.tables.0", "engram.tables.1"} <= every
    assert any("compressor.kv_proj" in n for n in every) and any("engram.wkv" in n for n in every)
    generator = torch.Generator().manual_seed(0)
    assert grads(trainer, trainer.losses(seqs, generator)["lm"]) == every - indexers - mtp
    assert grads(trainer, trainer.losses(seqs, generator)["indexer"]) == indexers
    assert grads(trainer, trainer.losses(seqs, generator)["mtp"]) >= mtp
    total = sum(trainer.losses(seqs, generator).values())
    assert grads(trainer, total) == every


def test_a_few_steps_lower_the_loss(tokenizer):
    _, trainer = tiny_trainer(tokenizer)
    seqs = sequences([96, 64], seed=3)
    optimizer = torch.optim.AdamW(parameter_groups(trainer, 0.1, 5.0), lr=3e-3)
    biases = [r.e_score_correction_bias.clone() for r in trainer.balance.routers]
    generator = torch.Generator().manual_seed(0)
    history = []
    for step in range(6):
        with trainer.wider_selection(4 if step < 2 else 1):
            losses = trainer.losses(seqs, generator)
        optimizer.zero_grad()
        (losses["lm"] + losses["indexer"] + 0.3 * losses["mtp"] + losses["needle"]).backward()
        optimizer.step()
        trainer.balance.update(1e-3)
        history.append({k: v.item() for k, v in losses.items()})
    assert history[-1]["lm"] < history[0]["lm"] - 0.05, history
    assert history[-1]["mtp"] < history[0]["mtp"], history
    assert any(not torch.equal(b, r.e_score_correction_bias) for b, r in zip(biases, trainer.balance.routers))
    assert [a.indexer.topk for a in trainer.distillation.sources.values()] == [8, 8, 8]  # the served top-k again


def test_targets_are_the_next_token_and_the_one_after():
    seqs = [TrainingSequence([0, 5, 6, 7]), TrainingSequence([0, 8, 9])]
    assert _shifted(seqs, 1, torch.device("cpu")).tolist() == [5, 6, 7, IGNORE, 8, 9, IGNORE]
    # the MTP rows: every row but a sequence's last, row p predicting token p + 2
    assert _shifted(seqs, 2, torch.device("cpu"), drop=1).tolist() == [6, 7, IGNORE, 9, IGNORE]


def test_a_run_saves_a_checkpoint_the_server_loads(tmp_path):
    """The script end to end on the CPU (CI dims, a handful of files, two steps): the checkpoint loads with
    the serving loader (which leaves out the MTP head's `mtp.*` tensors), its card holds the figures."""
    out = tmp_path / "tiny"
    card = main(["--out", str(out), "--device", "cpu", "--preset", "test", "--steps", "2", "--max-train-files", "12",
                 "--batch-tokens", "800", "--lm-len", "256", "--needle-min", "256", "--needle-max", "256",
                 "--eval-tokens", "600", "--eval-window", "128", "--eval-lengths", "128", "--needle-samples", "2",
                 "--continuation-tokens", "4", "--indexer-queries", "16"])
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json", "training_card.json"}
    assert json.loads((out / "training_card.json").read_text()) == card
    assert card["steps"] == 2 and card["held_out"]["tokens"] > 0 and set(card["needle"]) == {"128"}
    assert set(card["continuations"]) == {"def ", "class ", "import "} and "agreement_with_target" in card["mtp"]
    config = ModelConfig.from_file(out / "config.json")
    assert config.is_v41 and len(config.engram.layer_ids) == 2 and set(config.compress_rates) == {0, 1, 2}
    with safe_open(out / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.engram_tables.1.weight").dtype == torch.float8_e4m3fn
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert any(n.startswith("mtp.0.block.") for n in names)
    model = load_model(out)
    assert len(greedy_generate(model, [[BOS, 5, 6, 7]], 3)[0]) == 3
    again = main(["--out", str(out), "--eval-only", "--device", "cpu", "--max-train-files", "12",
                  "--eval-tokens", "600", "--eval-window", "128", "--eval-lengths", "128", "--needle-samples", "2",
                  "--continuation-tokens", "4"])
    for figure in ("held_out", "needle", "continuations", "mtp"):  # the saved model is the evaluated one
        assert again[figure] == card[figure]

    # --resume starts from the saved weights (the Engram tables from their fp8 rows), and the card adds up
    resume = ["--resume", str(out), "--device", "cpu", "--indexer-queries", "16"]
    _, resumed = build(parse_args(["--out", str(tmp_path / "next"), *resume]), load_tokenizer(), torch.device("cpu"))
    seqs = sequences([60])
    torch.testing.assert_close(serving_logits(resumed.model.eval(), seqs), serving_logits(model, seqs),
                               rtol=1e-5, atol=1e-5)
    more = main(["--out", str(tmp_path / "next"), *resume, "--steps", "1", "--max-train-files", "12",
                 "--batch-tokens", "256", "--lm-len", "256", "--needle-min", "256", "--needle-max", "256",
                 "--eval-tokens", "300", "--eval-window", "128", "--eval-lengths", "128", "--needle-samples", "1",
                 "--continuation-tokens", "2"])
    assert more["resumed_from"]["directory"] == str(out) and more["tokens_total"] == card["tokens"] + more["tokens"]


def test_rounding_to_the_stored_dtype_is_what_loads(tokenizer, tmp_path):
    """After round_to_stored the in-memory model is the bf16 checkpoint the loader reads back."""
    raw, trainer = tiny_trainer(tokenizer, seed=1)
    round_to_stored(trainer.modules(), torch.bfloat16)
    save_checkpoint(tmp_path, raw, trainer, tokenizer, torch.bfloat16)
    seqs = sequences([70])
    torch.testing.assert_close(serving_logits(load_model(tmp_path), seqs), serving_logits(trainer.model.eval(), seqs),
                               rtol=1e-5, atol=1e-5)


def test_corpus_split_and_prompt_splits(tokenizer):
    files = stdlib_files()
    train, held = split(files)
    paths = [f.path.relative_to(stdlib_root()) for f in files]
    assert [p.as_posix() for p in paths] == sorted(p.as_posix() for p in paths)
    assert {f.top for f in held} == set(HELD_OUT) and not {f.top for f in train} & set(HELD_OUT)
    assert not any(p.parts[0] in EXCLUDED_TOP or set(p.parts[:-1]) & set(EXCLUDED_DIRS) for p in paths)
    splits = space_splits(tokenizer)
    word = tokenizer.encode(" import", add_special_tokens=False).ids
    assert len(word) == 1 and tokenizer.decode(splits[word[0]]) == " import"
    assert tokenizer.encode("def ", add_special_tokens=False).ids[-1] == splits[word[0]][0]  # the lone space


def code_tokens(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def test_needle_samples_are_seeded_and_well_formed(tokenizer):
    filler = code_tokens(tokenizer, "x = 1\nif x:\n    y = 2\n" * 80)
    task = NeedleTask(tokenizer, filler, BOS)
    first = [task.sample(np.random.default_rng(7), 300, train=True) for _ in range(2)]
    assert first[0] == first[1]
    sample = first[0]
    assert len(sample.tokens) == 300 and sample.tokens[0] == BOS and len(sample.answers) == task.needles
    answered = tokenizer.decode([sample.tokens[r + 1] for r in sample.answer_rows])
    assert answered == "\n".join(sample.answers) + "\n"
    prompt = task.sample(np.random.default_rng(8), 256, train=False)
    assert len(prompt.tokens) == 256 and tokenizer.decode(prompt.tokens).endswith(" = '")
    name = tokenizer.decode(prompt.tokens).rsplit("\n", 1)[1][: -len(" = '")]
    assert f"{name} = '{prompt.answers[0]}\n" in tokenizer.decode(prompt.tokens)
    assert answer_matches("apple-12'\nfoo", "apple-12'") and not answer_matches("apple-1'", "apple-12'")
    many = packed(task, np.random.default_rng(9), [300, 256, 320], EOS)
    assert len(many.tokens) == 876 and many.tokens[0] == BOS and many.tokens[300] == many.tokens[556] == EOS
    assert tokenizer.decode([many.tokens[r + 1] for r in many.answer_rows]) == "\n".join(many.answers) + "\n"
    names = [line.split(" = ")[0] for line in tokenizer.decode(many.tokens).split("\n") if " = '" in line]
    assert len(set(names)) == 3 * task.needles  # every name once as a needle, once queried, none reused


def test_needle_accuracy_is_deterministic(tokenizer):
    _, trainer = tiny_trainer(tokenizer)
    filler = code_tokens(tokenizer, "def f(a):\n    return a\n" * 60)
    task = NeedleTask(tokenizer, filler, BOS)
    model = trainer.model.eval()
    scores = [needle_accuracy(model, task, 128, 3, seed=5) for _ in range(2)]
    assert scores[0] == scores[1] and 0.0 <= scores[0] <= 1.0
