"""The tiny random checkpoint of the tests: a small DeepSeek-V4.1 (or V4) with seeded random weights and
its own tokenizer. (The embedded default the server ships, default_model/, is a trained one:
tools/train_tiny.py.)

Everything is deterministic (fixed corpus, fixed seed), so `python -m models.tiny --out DIR` on any
machine writes the same model, at sizes a CPU runs in milliseconds. The V4.1 family (the default)
exercises CSA2 (ratio 2 and ratio 1 kv sources, a re-indexing layer, the two-level top-k), the
simulated fp8/fp4 formats and Engram on two layers with fp8 tables; `--family v4` writes a V4
(sliding, CSA and HCA layers, hash and top-k MoE). It is not a trained model: its text is noise, its
tokens are what the tests compare.

    python -m models.tiny --out DIR [--family v4]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kernels.fake_quant import FP8_MAX, pow2_ceil
from models.config import ModelConfig
from models.engram_setup import engram_hasher
from models.random_model import meta_model, random_tensor

SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
]
TOKENIZER_VOCAB = 512

CORPUS = [
    "ds4serve is an inference server for the DeepSeek-V4 model family.",
    "It speaks the OpenAI protocol: completions, chat completions, streaming and tools.",
    "The quick brown fox jumps over the lazy dog while the server keeps serving tokens.",
    "Compressed sparse attention pools four tokens into one entry; an indexer picks the top entries.",
    "Heavily compressed attention pools many tokens into one entry that every later query can see.",
    "Engram memory looks up hashed n-grams in huge tables streamed from NVMe through io_uring.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42.",
    "Multi-turn chats resend the whole conversation, so a prefix cache saves the prefill.",
    "Bonjour le monde. Hola mundo. Hallo Welt. Ciao mondo. Olá mundo.",
    "Continuous batching mixes decode tokens and prefill chunks in every step of the engine.",
]


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """HF transformers' DeepseekV4Config keys for a small model; overrides replace keys (None drops one)."""
    config: dict[str, Any] = {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": TOKENIZER_VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "sliding_window": 16,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


def tiny_v41_config_dict(**overrides: Any) -> dict[str, Any]:
    """HF DeepseekV41TextConfig keys (the flat `deepseek_v41_text` form); overrides replace keys (None
    drops one). The Engram sizes that depend on the tokenizer are filled in by the builder."""
    config: dict[str, Any] = {
        "model_type": "deepseek_v41_text",
        "architectures": ["DeepseekV41ForCausalLM"],
        "vocab_size": TOKENIZER_VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "compress_ratios": [0, 2, 2, 1, 1, 0],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4],
        "candidate_source_layer_id": 3,
        "candidate_block_size": 8,
        "candidate_topk_blocks": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "gate_temp": 1.0,
        "norm_topk_prob": True,
        "sliding_window": 16,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 16.0,
                "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
            },
        },
        "engram_layer_ids": [1, 4],
        "engram_vocab_size": 2000,
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_id": 2,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


def quantize_engram_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float rows -> (float8_e4m3fn values, float32 power-of-two scales per 32 channels), as V4.1 stores
    its tables (`weight` and `weight_scale_inv`)."""
    blocks = rows.float().view(rows.shape[0], -1, 32)
    scales = pow2_ceil(blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)
    values = (blocks / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(rows.shape), scales.squeeze(-1)


def random_weights(config: ModelConfig, seed: int = 0, engram_tables: bool = True) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so activations stay O(1) through every layer (no dead branches), by
    models/random_model.py's rule; the MTP layers' last (`mtp.N.*`), when a V4 config has them.
    `engram_tables=False` leaves the (possibly huge) Engram tables to the caller."""
    generator = torch.Generator().manual_seed(seed)
    model = meta_model(config, mtp=config.num_nextn_predict_layers > 0)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        weights[name] = random_tensor(name, tensor.shape, config.n_routed_experts, generator)
    if config.engram is not None and engram_tables:
        for layer, rows in zip(config.engram.layer_ids, config.engram.num_embeddings):
            values, scales = quantize_engram_rows(torch.randn((rows, config.engram.head_dim), generator=generator))
            weights[f"model.engram_tables.{layer}.weight"] = values
            weights[f"model.engram_tables.{layer}.weight_scale_inv"] = scales
    return weights


def build_tokenizer(path: Path, extra_tokens: Sequence[str] = ()) -> None:
    """A byte-level BPE trained on CORPUS; `extra_tokens` are appended as plain (non-special) added
    tokens, so tests can give multi-character strings such as DSML tags one token id each."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_tokens([AddedToken(text, normalized=False) for text in extra_tokens])
    tokenizer.save(str(path))


def build_tiny_checkpoint(
    out: str | Path, seed: int = 0, family: str = "v41", extra_tokens: Sequence[str] = (), **config_overrides: Any
) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and friends into `out`.
    `family`: "v41" (the default model) or "v4"; `config_overrides` replace that family's keys;
    `extra_tokens` become added tokens after the trained vocabulary (which grows to hold them)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family not in ("v4", "v41"):
        raise ValueError(f"family {family!r} is not 'v4' or 'v41'")
    config_overrides.setdefault("vocab_size", TOKENIZER_VOCAB + len(extra_tokens))
    raw = tiny_config_dict(**config_overrides) if family == "v4" else tiny_v41_config_dict(**config_overrides)
    build_tokenizer(out / "tokenizer.json", extra_tokens)
    config = ModelConfig.from_dict(raw)
    if config.engram is not None:  # table sizes and the compressed vocabulary follow from the tokenizer
        from tokenizers import Tokenizer

        hasher = engram_hasher(config.engram, Tokenizer.from_file(str(out / "tokenizer.json")))
        raw["engram_compressed_vocab_size"] = int(hasher.lookup.max()) + 1
        raw["engram_num_embeddings"] = list(hasher.layout.num_embeddings)
        config = ModelConfig.from_dict(raw)
    save_file({k: v.contiguous() for k, v in random_weights(config, seed).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}, indent=2) + "\n"
    )
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True,
        "model_max_length": raw["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=["v41", "v4"], default="v41")
    args = parser.parse_args()
    print(build_tiny_checkpoint(args.out, seed=args.seed, family=args.family))


if __name__ == "__main__":
    main()
