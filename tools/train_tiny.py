"""Trains the tiny default model: a small DeepSeek-V4.1 on the Python standard library's own source.

    python -m tools.train_tiny --out default_model --device cuda --minutes 7.0 --seed 0

default_model/, the embedded default the repository ships, is the output of this run (written to
/tmp/tiny on an H200 and copied): its training_card.json records the command, the device and the figures.

Every feature of the V4.1 family stays (Engram on two layers, CSA2 with ratio-2 and ratio-1 kv sources,
a re-indexing layer and the two-level top-k, single-pass mHC, routed + shared MoE) and an MTP layer is
trained beside it (models/mtp_v41.py, the layer the "mtp" proposer serves). The forward is the serving
code's (tools/tiny_training.py says how it is differentiated), so the saved weights are the served function. Data (tools/stdlib_corpus.py):
the stdlib's files minus a held-out set of modules, with the shipped byte-level BPE
(tools/tiny_tokenizer.json); mixed in, key-value recall samples up to 4K tokens (tools/needle.py), so
that retrieval through the compressed caches is trained at the full context (their longest length grows
from 512 to 4,096 tokens over the first half; over the first fifth the indexers pick 4x their entries,
`TinyTrainer.wider_selection`, so the attention learns from more entries before it trains at the
served sparsity). Seeded: the data order, the initial weights and, with `--steps`, the schedule are
fixed by the seed (`--minutes` stops on the clock, so the step count follows the device's speed; the
card records it and `--steps` replays it; CUDA's scatter-add backward is not bitwise reproducible).

Why these dims (`model_config`): the safetensors must stay near 16 MB. Matrices are stored in bf16
(vectors in float32): hidden 256, 6 layers, 4 heads of 64 (16 RoPE dims), q rank 128, output groups
2 x 64, 8 routed experts of 64 (top 2) and a shared one, a vocabulary of 4,096: 6.3M parameters; the
MTP layer 0.76M more. The two Engram tables (2 hash heads x n-gram orders 2 and 3, primes from 5,000,
rows of 32 in fp8 with a scale each) hold 1.29M values: 15.7 MB in all. The window is the release's
128 tokens, the indexers pick 64 entries (the ratio-2 source sees 2,048 at 4K tokens, the ratio-1 ones
4,096), the candidate source 16 blocks of 8.

On a GPU this model is bound by kernel launches, not by arithmetic (forward and backward, ~2,300
kernels a sequence and ~10,000 a step on top, whatever the lengths; on this project's 2-core CPU the
Python side of that alone is ~0.065 s a sequence and ~0.26 s a step), so a step takes few long
sequences: 4K-token language-model windows, 32K tokens a step. Memory bounds the batch: the backward
keeps ~6 GB for a 4K-token sequence (measured on the CPU; a quarter of it the window attention's dense
[heads, T, T] scores, which the serving prefill computes so), ~50 GB a step, inside one H200 with
room; a step that runs out of memory halves the batch and is retried.

The run ends by saving the checkpoint (config.json, model.safetensors, tokenizer files,
generation_config.json) and evaluating what was saved, loaded by the serving loader: held-out loss in
nats per token against unigram baselines on the same tokens, needle accuracy at 1K / 2K / max context
by greedy generation through the serving forward, greedy continuations of `def ` / `class ` / `import `,
and the MTP head's agreement with the target; `training_card.json` holds the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from models import ForwardBatch, ModelCache, ModelConfig, load_model
from models.engram_setup import engram_hasher
from models.model_v41 import DeepseekV41
from models.mtp_v41 import MTPLayerV41
from models.tiny import SPECIAL_TOKENS, tiny_v41_config_dict
from tools.needle import NeedleTask, greedy_generate, needle_accuracy, packed
from tools.stdlib_corpus import (
    SHIPPED_TOKENIZER,
    corpus_fingerprint,
    encode_files,
    file_starts,
    load_tokenizer,
    split,
    stdlib_files,
)
from tools.tiny_training import (
    TinyTrainer,
    TrainableEngramTables,
    TrainingSequence,
    attach_trainable_engram,
    checkpoint_tensors,
    init_parameters,
    lr_at,
    parameter_groups,
    reference_kernels,
    round_to_stored,
)

BOS, EOS = 0, 1
PROMPTS = ("def ", "class ", "import ")


def model_config(tokenizer, preset: str = "default") -> dict:
    """config.json of the trained model (`preset` "test": the dims of models/tiny.py, for CI runs)."""
    dims = dict(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=128,
        index_n_heads=8, index_head_dim=32, index_topk=64, candidate_topk_blocks=16, rms_norm_eps=1e-6,
        engram_vocab_size=5000, engram_n_heads=2, engram_head_dim=32, num_nextn_predict_layers=1,
    )
    if preset == "test":
        dims.update(hidden_size=64, q_lora_rank=32, o_lora_rank=16, moe_intermediate_size=32, sliding_window=16,
                    index_topk=8, candidate_topk_blocks=2, engram_vocab_size=2000)
    raw = tiny_v41_config_dict(**dims)
    config = ModelConfig.from_dict(raw)
    hasher = engram_hasher(config.engram, tokenizer)
    raw["engram_compressed_vocab_size"] = int(hasher.lookup.max()) + 1
    raw["engram_num_embeddings"] = list(hasher.layout.num_embeddings)
    return raw


# -- data --------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    train: np.ndarray  # int32 token stream of the training files (each file then EOS)
    held_out: np.ndarray
    starts: np.ndarray  # where training files begin in `train`
    fingerprint: dict


def load_corpus(tokenizer, max_files: int | None = None) -> Corpus:
    files = stdlib_files()
    train, held = split(files)
    if max_files:  # CI: a deterministic handful
        train, held = train[:: max(1, len(train) // max_files)][:max_files], held[:2]
    stream = encode_files(tokenizer, train, EOS)
    return Corpus(stream, encode_files(tokenizer, held, EOS), file_starts(stream, EOS), corpus_fingerprint(files))


def space_splits(tokenizer) -> dict[int, list[int]]:
    """Tokens ' word' -> [' ', 'word'] ids: how a prompt that ends in a space (`def `) tokenizes, which
    whole-text tokenizing almost never shows the model; some training samples are split so."""
    space = tokenizer.token_to_id("Ġ")
    out = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token.startswith("Ġ") and len(token) > 1 and token[1] != "Ġ" and token_id >= len(SPECIAL_TOKENS):
            rest = tokenizer.encode(tokenizer.decode([token_id])[1:], add_special_tokens=False).ids
            out[token_id] = [space] + rest
    return out


class Sampler:
    """The training batches: language-model windows of the training stream (half from a file's start;
    some with a space split off a word, as a prompt ending in a space tokenizes) and windows of packed
    key-value recall samples whose longest length grows to `needle_max` over the first half of training.
    Every sequence is `lm_len` tokens: a step's cost is mostly per sequence (see the module docstring)."""

    def __init__(self, corpus: Corpus, task: NeedleTask, splits: dict[int, list[int]], args) -> None:
        self.corpus, self.task, self.splits, self.args = corpus, task, splits, args

    def batch(self, step: int, progress: float, batch_tokens: int) -> list[TrainingSequence]:
        rng = np.random.default_rng([self.args.seed, step])
        out, total = [], 0
        while total < batch_tokens:
            if rng.random() < self.args.needle_share:
                out.append(self._needle(rng, progress))
            else:
                out.append(self._window(rng))
            total += len(out[-1].tokens)
        return out

    def _window(self, rng: np.random.Generator) -> TrainingSequence:
        stream, length = self.corpus.train, self.args.lm_len
        if rng.random() < 0.5:
            start = int(self.corpus.starts[rng.integers(len(self.corpus.starts))])
        else:
            start = int(rng.integers(len(stream)))
        start = min(start, len(stream) - length)
        tokens = stream[start : start + length].tolist()
        if rng.random() < 0.5:
            places = [i for i, t in enumerate(tokens) if t in self.splits]
            for i in sorted(rng.choice(places, size=min(3, len(places)), replace=False).tolist(), reverse=True):
                tokens[i : i + 1] = self.splits[tokens[i]]
        return TrainingSequence([BOS] + tokens[: length - 1])

    def _needle(self, rng: np.random.Generator, progress: float) -> TrainingSequence:
        """A window's worth of recall samples (packed), each of a length up to the curriculum's."""
        low, high = self.args.needle_min, self.args.needle_max
        top = low + (high - low) * min(1.0, progress / 0.5)
        lengths, remaining = [], self.args.lm_len
        while remaining > 0:
            length = int(rng.uniform(low, top)) // 64 * 64 or low
            length = remaining if remaining - length < low else length
            lengths.append(length)
            remaining -= length
        sample = packed(self.task, rng, lengths, EOS)
        return TrainingSequence(sample.tokens, sample.answer_rows)


# -- evaluation --------------------------------------------------------------------------------------

@torch.inference_mode()
def held_out_loss(model, stream: np.ndarray, window: int, max_tokens: int, batch_size: int = 16) -> dict:
    """Teacher-forced loss of `model` (the serving forward) over the held-out stream cut into windows
    (BOS + window - 1 tokens, every token after BOS predicted), and what it predicted."""
    usable = min(len(stream), max_tokens)
    windows = [stream[i : i + window - 1].tolist() for i in range(0, usable - window + 1, window - 1)]
    total, count, targets = 0.0, 0, []
    device = model.lm_head.weight.device
    for first in range(0, len(windows), batch_size):
        group = [[BOS] + w for w in windows[first : first + batch_size]]
        cache = ModelCache.allocate(model.config, len(group), window, device=device)
        rows = [list(range(len(g) - 1)) for g in group]
        logits = model(ForwardBatch.build([(i, g, 0) for i, g in enumerate(group)], logits=rows), cache)
        wanted = torch.tensor([t for g in group for t in g[1:]], device=device)
        total += F.cross_entropy(logits.float(), wanted, reduction="sum").item()
        count += wanted.numel()
        targets += wanted.tolist()
    return {"loss": total / count, "tokens": count, "targets": np.asarray(targets)}


def unigram_baselines(train: np.ndarray, targets: np.ndarray, vocab: int) -> dict:
    """Cross-entropy (nats / token) on `targets` of the training stream's unigram (add-one smoothed), and
    the entropy of the targets' own unigram (the best any unigram could do on them)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1
    log_p = np.log(counts / counts.sum())
    own = np.bincount(targets, minlength=vocab).astype(np.float64)
    own = own[own > 0] / own.sum()
    return {"unigram_train_nats": float(-log_p[targets].mean()),
            "unigram_held_out_entropy_nats": float(-(own * np.log(own)).sum())}


def continuations(model, tokenizer, new_tokens: int) -> dict[str, str]:
    prompts = [[BOS] + tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    generated = greedy_generate(model, prompts, new_tokens)
    return {p: p + tokenizer.decode(g) for p, g in zip(PROMPTS, generated)}


# -- the run -----------------------------------------------------------------------------------------

def build(args, tokenizer, device: torch.device) -> tuple[dict, TinyTrainer]:
    """The model, MTP head and Engram tables: initialised from the seed, or `--resume`'s checkpoint."""
    if args.resume:
        raw = json.loads((args.resume / "config.json").read_text())
    else:
        raw = model_config(tokenizer, args.preset)
    config = ModelConfig.from_dict(raw)
    model = DeepseekV41(config)
    mtp = MTPLayerV41(config, 0, model.model.embed_tokens, model.lm_head) if args.mtp else None
    rows = config.engram.layout.num_embeddings
    tables = TrainableEngramTables([torch.empty(n, config.engram.head_dim) for n in rows])
    modules = {"": model, "engram.": tables} | ({"mtp.0.": mtp} if mtp is not None else {})
    init_parameters(modules, config.num_layers, args.seed)
    if args.resume:
        load_weights(args.resume, model, mtp, tables)
    for module in modules.values():
        module.to(device).train()
    attach_trainable_engram(model, tokenizer, tables)
    return raw, TinyTrainer(model, mtp, tables, indexer_queries=args.indexer_queries)


@torch.no_grad()
def load_weights(directory: Path, model: DeepseekV41, mtp: MTPLayerV41 | None, tables: TrainableEngramTables) -> None:
    """A saved run's weights into the training modules (the Engram tables from their fp8 rows; an MTP
    head the checkpoint lacks keeps its initial weights)."""
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
        for prefix, module in (("", model), ("mtp.0.", mtp)):
            if module is None or (prefix and not any(n.startswith(prefix) for n in names)):
                continue
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                tensor.copy_(handle.get_tensor(prefix + name))
        for layer, table in zip(model.config.engram.layer_ids, tables.tables):
            values = handle.get_tensor(f"model.engram_tables.{layer}.weight").float()
            scales = handle.get_tensor(f"model.engram_tables.{layer}.weight_scale_inv").float()
            table.copy_(values * scales.repeat_interleave(values.shape[1] // scales.shape[1], dim=1))


def train(args, trainer: TinyTrainer, sampler: Sampler, log) -> dict:
    groups = parameter_groups(trainer, args.weight_decay, args.engram_lr_scale)
    fused = trainer.device.type == "cuda"  # one kernel for the update instead of a few per parameter group
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    params = [p for g in groups for p in g["params"]]
    budget, start, step, tokens = args.minutes * 60, time.time(), 0, 0
    batch_tokens = args.batch_tokens
    generator = torch.Generator().manual_seed(args.seed)
    while True:
        elapsed = time.time() - start
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(progress, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        sequences = sampler.batch(step, progress, batch_tokens)
        try:
            with trainer.wider_selection(args.wide_factor if progress < args.wide_share else 1):
                losses = trainer.losses(sequences, generator)
            total = (losses["lm"] + args.needle_weight * losses["needle"] + args.indexer_weight * losses["indexer"]
                     + args.mtp_weight * losses.get("mtp", 0.0))
            optimizer.zero_grad(set_to_none=True)
            total.backward()
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if batch_tokens <= args.lm_len:
                raise
            batch_tokens //= 2
            log({"event": "out of memory", "step": step, "batch_tokens": batch_tokens})
            continue
        if step == 0:  # on CUDA, a kernel without a backward would show here
            missing = [prefix + n for prefix, m in trainer.modules().items() for n, p in m.named_parameters()
                       if p.grad is None or not p.grad.any()]
            log({"event": "parameters without a gradient", "names": missing})
        norm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        imbalance = trainer.balance.update(args.balance_rate)
        step += 1
        tokens += sum(len(s.tokens) for s in sequences)
        if step <= 10 or step % args.log_every == 0:
            record = {"step": step, "elapsed_s": round(time.time() - start, 2), "lr": lr, "tokens": tokens,
                      "sequences": len(sequences), "grad_norm": float(norm), "expert_load_max_over_mean": imbalance}
            record |= {k: round(v.item(), 4) for k, v in losses.items()}
            if torch.cuda.is_available() and trainer.device.type == "cuda":
                record["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            log(record)
    return {"steps": step, "tokens": tokens, "train_seconds": round(time.time() - start, 1),
            "batch_tokens": batch_tokens}


def save_checkpoint(out: Path, raw: dict, trainer: TinyTrainer, tokenizer, dtype: torch.dtype) -> int:
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(trainer.model, trainer.mtp, trainer.tables, dtype)
    save_file(tensors, str(out / "model.safetensors"))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}, indent=2) + "\n")
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True, "model_max_length": raw["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return sum(t.numel() for t in tensors.values())


def evaluate(args, model, trainer: TinyTrainer, corpus: Corpus, tokenizer) -> dict:
    """Figures of `model`, the saved checkpoint loaded as the server loads it, through the serving
    forward; the MTP head's agreement through `trainer` (no V4.1 MTP proposer serves it)."""
    max_len = model.config.max_position_embeddings
    held = held_out_loss(model, corpus.held_out, args.eval_window, args.eval_tokens)
    figures = {"held_out": {"tokens": held["tokens"], "window": args.eval_window, "loss_nats": held["loss"]}}
    figures["held_out"] |= unigram_baselines(corpus.train, held["targets"], tokenizer.get_vocab_size())
    figures["held_out"]["below_unigram_nats"] = figures["held_out"]["unigram_train_nats"] - held["loss"]
    task = NeedleTask(tokenizer, corpus.held_out, BOS)
    lengths = [max_len - 16 if x == "max" else int(x) for x in args.eval_lengths.split(",")]
    figures["needle"] = {
        str(length): needle_accuracy(model, task, length, args.needle_samples, seed=args.seed + 1000 + length,
                                     batch_size=args.eval_batch)
        for length in lengths
    }
    figures["needle_samples"] = args.needle_samples
    figures["continuations"] = continuations(model, tokenizer, args.continuation_tokens)
    if trainer.mtp is not None:
        window = args.eval_window
        pieces = [corpus.held_out[i : i + window - 1].tolist() for i in range(0, 8 * window, window)]
        sequences = [TrainingSequence([BOS] + w) for w in pieces if len(w) == window - 1]
        agree, correct, rows = trainer.mtp_agreement(sequences)
        figures["mtp"] = {"agreement_with_target": agree, "accuracy": correct, "rows": rows,
                          "note": "teacher-forced on held-out text; served by --speculative-config method mtp"}
    return figures


def load_trained(out: Path, device: torch.device) -> tuple[DeepseekV41, TinyTrainer]:
    """A saved run as the server loads it, with its MTP layer (`mtp.0.*`, models/mtp_v41.py) when it has one."""
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        has_mtp = any(name.startswith("mtp.0.") for name in handle.keys())
    model = load_model(out, device=str(device), mtp=has_mtp)
    return model, TinyTrainer(model, model.mtp[0] if has_mtp else None, None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=6.5, help="training time budget (evaluation comes after)")
    p.add_argument("--steps", type=int, default=0, help="a fixed step count for the schedule instead of the clock")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps whatever the schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=["default", "test"], default="default")
    p.add_argument("--resume", type=Path, default=None,
                   help="start from this saved run's weights (its config.json; a fresh optimizer and schedule)")
    p.add_argument("--mtp", type=int, default=1, help="train the MTP head (1) or not (0)")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lm-len", type=int, default=4096, help="language-model window (tokens)")
    p.add_argument("--needle-share", type=float, default=0.75, help="share of windows of packed recall samples")
    p.add_argument("--needle-min", type=int, default=512)
    p.add_argument("--needle-max", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="share of training spent warming up")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--engram-lr-scale", type=float, default=5.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--needle-weight", type=float, default=2.0, help="weight of the loss on recall answers")
    p.add_argument("--indexer-weight", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--balance-rate", type=float, default=3e-3, help="expert bias step (aux-loss-free balance)")
    p.add_argument("--indexer-queries", type=int, default=256, help="query rows per sequence in the indexer loss")
    p.add_argument("--wide-share", type=float, default=0.2, help="share of training with a wider selection")
    p.add_argument("--wide-factor", type=int, default=4, help="top-k and candidate blocks times this meanwhile")
    p.add_argument("--save-dtype", choices=["bf16", "float32"], default="bf16")
    p.add_argument("--tokenizer", type=Path, default=SHIPPED_TOKENIZER)
    p.add_argument("--max-train-files", type=int, default=0, help="CI: train on a handful of files")
    p.add_argument("--eval-only", action="store_true", help="evaluate the checkpoint already in --out")
    p.add_argument("--eval-tokens", type=int, default=1 << 30, help="held-out tokens to evaluate (default all)")
    p.add_argument("--eval-window", type=int, default=1024, help="held-out windows (BOS + window - 1 tokens)")
    p.add_argument("--eval-batch", type=int, default=16, help="needle prompts per forward")
    p.add_argument("--eval-lengths", default="1024,2048,max", help="needle prompt lengths ('max': the context)")
    p.add_argument("--needle-samples", type=int, default=64)
    p.add_argument("--continuation-tokens", type=int, default=48)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def log(record: dict) -> None:
        print(json.dumps(record), flush=True)

    tokenizer = load_tokenizer(args.out / "tokenizer.json" if args.eval_only else args.tokenizer)
    corpus = load_corpus(tokenizer, args.max_train_files or None)
    log({"event": "corpus", **corpus.fingerprint, "train_tokens": int(len(corpus.train)),
         "held_out_tokens": int(len(corpus.held_out))})
    card_file = args.out / "training_card.json"
    with reference_kernels():
        if args.eval_only:
            card = json.loads(card_file.read_text()) if card_file.exists() else {}
            model, trainer = load_trained(args.out, device)
        else:
            card, trainer = run_training(args, argv, tokenizer, corpus, device, log)
            model = load_model(args.out, device=str(device))
        card |= evaluate(args, model, trainer, corpus, tokenizer)
    card["wall_seconds" if not args.eval_only else "evaluation_wall_seconds"] = round(time.time() - started, 1)
    card_file.write_text(json.dumps(card, indent=2) + "\n")
    args.out.joinpath("training_card.md").write_text(card_markdown(card))
    log({"event": "card", **card})
    return card


def run_training(args, argv, tokenizer, corpus: Corpus, device: torch.device, log) -> tuple[dict, TinyTrainer]:
    """Builds, trains and saves the model (its weights rounded to what is stored); the card's training half."""
    previous = None
    if args.resume:  # before the run overwrites it, when --out is the same directory
        card_file = args.resume / "training_card.json"
        earlier = json.loads(card_file.read_text()) if card_file.exists() else {}
        previous = {"directory": str(args.resume)}
        previous |= {k: earlier.get(k) for k in ("command", "tokens_total", "train_seconds_total", "resumed_from")}
    raw, trainer = build(args, tokenizer, device)
    sampler = Sampler(corpus, NeedleTask(tokenizer, corpus.train, BOS), space_splits(tokenizer), args)
    dtype = torch.bfloat16 if args.save_dtype == "bf16" else torch.float32
    run = train(args, trainer, sampler, log)
    for module in trainer.modules().values():
        module.eval()
    round_to_stored(trainer.modules(), dtype)
    stored = save_checkpoint(args.out, raw, trainer, tokenizer, dtype)
    card = {
        "command": "python -m tools.train_tiny " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "corpus": corpus.fingerprint,
        "tokenizer_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest(),
        "resumed_from": previous,
        "parameters": parameter_counts(trainer, stored),
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
        **run,
        "tokens_per_second": round(run["tokens"] / max(run["train_seconds"], 1e-9)),
        "tokens_total": run["tokens"] + ((previous or {}).get("tokens_total") or 0),
        "train_seconds_total": run["train_seconds"] + ((previous or {}).get("train_seconds_total") or 0),
    }
    return card, trainer


def card_markdown(card: dict) -> str:
    """The card as README table rows."""
    held, params, corpus = card["held_out"], card.get("parameters", {}), card.get("corpus", {})
    needle = ", ".join(f"{int(k):,} tokens: {v:.0%}" for k, v in card["needle"].items())
    lines = [
        "| | |", "| --- | --- |",
        f"| parameters | {params.get('model', 0):,}, Engram tables {params.get('engram_tables', 0):,} (fp8), "
        f"MTP head {params.get('mtp', 0):,}; model.safetensors {card.get('safetensors_bytes', 0) / 1e6:.1f} MB |",
        f"| training | {card.get('tokens_total', 0):,} tokens, {card.get('train_seconds_total', 0):.0f} s "
        f"on {card.get('device', '?')} ({card.get('steps', 0):,} steps of the last run, "
        f"{card.get('wall_seconds', 0):.0f} s with its evaluation): `{card.get('command', '')}`"
        + (f" after `{card['resumed_from']['command']}`" if card.get("resumed_from") else "") + " |",
        f"| corpus | Python {corpus.get('python', '?')}'s stdlib sources: "
        f"{corpus.get('bytes', {}).get('train', 0):,} bytes trained on, {corpus.get('bytes', {}).get('held_out', 0):,} "
        "held out |",
        f"| held-out loss | {held['loss_nats']:.3f} nats / token over {held['tokens']:,} tokens; unigram "
        f"{held['unigram_train_nats']:.3f} (the held-out tokens' own unigram entropy "
        f"{held['unigram_held_out_entropy_nats']:.3f}) |",
        f"| key-value recall | {needle} ({card['needle_samples']} prompts each, greedy, exact match) |",
    ]
    if "mtp" in card:
        lines.append("| MTP head | its greedy draft is the target's next greedy token "
                     f"{card['mtp']['agreement_with_target']:.0%} of the time (teacher-forced, held-out) |")
    for prompt, text in card["continuations"].items():
        shown = json.dumps(text)[1:-1].replace("|", "\\|").replace("`", "'")
        lines.append(f"| `{prompt}` | `{shown}` |")
    return "\n".join(lines) + "\n"


def parameter_counts(trainer: TinyTrainer, stored: int) -> dict:
    counts = {prefix or "model": sum(p.numel() for p in m.parameters()) for prefix, m in trainer.modules().items()}
    return {"model": counts["model"], "engram_tables": counts.get("engram.", 0), "mtp": counts.get("mtp.0.", 0),
            "stored_values": stored}


if __name__ == "__main__":
    main()
