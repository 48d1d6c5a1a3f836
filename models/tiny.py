"""The tiny default checkpoint: a small DeepSeek-V4 with seeded random weights and its own tokenizer.

Everything is deterministic (fixed corpus, fixed seed), so `make tiny-model` on any machine writes
the same model. It exercises every V4 feature (sliding, CSA and HCA layers, hash and top-k MoE,
mHC with 4 streams, YaRN on the compressed branches) at sizes a CPU runs in milliseconds.
It is not a trained model: its text is noise, its tokens are what the tests compare.

    python -m models.tiny --out checkpoints/tiny
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from models.config import ModelConfig
from models.model import DeepseekV4

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


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so activations stay O(1) through every layer (no dead branches)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV4(config)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std + mean

    weights: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        shape, leaf = tensor.shape, name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            rows = [torch.randperm(config.n_routed_experts, generator=generator)[: shape[1]] for _ in range(shape[0])]
            weights[name] = torch.stack(rows)
        elif "norm" in name:
            weights[name] = normal(shape, 0.1, mean=1.0)
        elif leaf in ("scale", "hc_scale"):
            weights[name] = torch.rand(shape, generator=generator) + 0.5
        elif leaf in ("base", "hc_base", "e_score_correction_bias"):
            weights[name] = normal(shape, 0.1)
        elif leaf in ("sinks", "position_bias"):
            weights[name] = normal(shape, 0.5)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = normal(shape, 1.0)
        else:  # projections: fan-in is the last dim
            weights[name] = normal(shape, 1.0 / math.sqrt(shape[-1]))
    return weights


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tokenizer.save(str(path))


def build_tiny_checkpoint(out: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and friends into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(**config_overrides)
    build_tokenizer(out / "tokenizer.json")
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
    parser.add_argument("--out", default="checkpoints/tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_checkpoint(args.out, seed=args.seed))


if __name__ == "__main__":
    main()
