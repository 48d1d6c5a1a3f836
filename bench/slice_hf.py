"""transformers' DeepseekV4ForCausalLM on the same slice and the SAME weight tensors, for a peer figure.

Our parameter names are transformers' (models/model.py), so the HF model is built on the meta device
and our tensors are assigned into it: no second copy of the 55 GB, the same numbers in both. Only
tensors whose dtype differs between the two are copied (none at bf16: both keep norms, mHC, sinks and
biases in float32). transformers is a test dependency, not a product one: imported here on demand.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from models.model import DeepseekV4


def _transformers():
    try:
        import transformers
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as exc:
        raise SystemExit(
            f"bench.slice transformers needs transformers >= 5.24 with DeepseekV4 ({exc}); on the GPU machine "
            "install the carried wheel: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl"
        ) from exc
    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


def hf_sharing_weights(model: DeepseekV4, raw_config: dict[str, Any], experts: str) -> Any:
    """transformers' model over `model`'s tensors (eager attention, its only backend; `experts` picks
    its MoE implementation, e.g. grouped_mm)."""
    _, DeepseekV4Config, DeepseekV4ForCausalLM = _transformers()
    config = DeepseekV4Config(**{k: v for k, v in raw_config.items() if k not in ("model_type", "architectures")})
    dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM._from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation=experts
        )
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    wanted = hf.state_dict()
    missing = sorted(set(wanted) - set(ours))
    if missing:
        raise SystemExit(f"transformers' model has tensors ours lacks: {missing[:5]}")
    hf.load_state_dict({name: ours[name].to(wanted[name].dtype) for name in wanted}, assign=True, strict=True)
    _rebuild_meta_modules(hf, config, device)
    return hf.eval()


def _rebuild_meta_modules(hf: torch.nn.Module, config: Any, device: torch.device) -> None:
    """Non-persistent buffers (the rotary tables) are not in the state dict: their modules are built
    again on the device. Any other tensor still on meta is an error."""
    for name, module in list(hf.named_modules()):
        on_meta = any(b.is_meta for b in module.buffers(recurse=False))
        if not on_meta:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise SystemExit(f"transformers' module {name} ({type(module).__name__}) kept meta buffers")
        parent, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(parent), leaf, type(module)(config, device=device))
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise SystemExit(f"transformers' model still has meta tensors: {left[:5]}")


class RandomNextTokens:
    """A logits processor that forces a seeded random next token per row: a random model's greedy
    output tends to repeat one token, which would route every row to the same experts and read fewer
    weight bytes than real traffic. Our decode bench feeds random tokens the same way."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = torch.randint(3, self.vocab_size, (scores.shape[0], 1), generator=self.generator, device=scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


def time_generate(hf: Any, prompts: torch.Tensor, new_tokens: int, seed: int) -> float:
    """Seconds of one greedy `generate` of exactly `new_tokens` tokens per row (synchronized)."""
    transformers, _, _ = _transformers()
    processors = transformers.LogitsProcessorList([RandomNextTokens(hf.config.vocab_size, prompts.device, seed)])
    if prompts.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, logits_processor=processors,
            pad_token_id=hf.config.pad_token_id or 0,
        )
    if prompts.device.type == "cuda":
        torch.cuda.synchronize()
    assert out.shape[1] == prompts.shape[1] + new_tokens, f"generate stopped early: {tuple(out.shape)}"
    return time.perf_counter() - start
