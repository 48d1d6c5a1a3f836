"""DSpark draft layers (issue 27): a block of drafts per step from taps of the target, for DeepSeek-V4.1 and
for a V4 / V4-Flash target (V4-Flash-0731's draft: its differences below the tensor tables).

What DSpark is, from DeepSeek's DeepSpec (`deepspec/modeling/dspark`: the draft model, its mask token,
target-layer taps, Markov and confidence heads; `deepspec/eval/dspark`: how a block is proposed and cut)
and, for this family's layers, DeepSeek-V4.1-Flash's own `inference/model.py` (`DSparkBlock`,
`DSparkAttention`, `forward_spec`: its stages are V4.1 sliding-window layers with mHC and a routed MoE,
stored beside the model as `mtp.{i}.*`). Written from that math, not from their code.

For one sequence whose target computed positions up to L and drew the token t at L + 1:

    tap[p]   = concat over j of mean_hc(streams entering target layer dspark_target_layer_ids[j], at p)
               (after that layer's Engram; the release: "reads the attention input of its target layers")
    main[p]  = main_norm(main_proj(tap[p]))                                   (stage 0's, [D])
    ctx_i[p] = fp8(rope(kv_norm_i(kv_proj_i(main[p])), p))     stage i's context key (= value) at p: the
               release keeps the last `sliding_window` of them per stage in a ring (`allocate_rings`)
    block    = [t, noise, ..., noise] (dspark_block_size tokens, DeepSpec's mask token) at L + 1 .. L + B
    x        = embed(block) on every mHC stream; each stage a V4.1 layer (mHC sites, attention, MoE) whose
               attention has the block rows as queries and as keys both ctx_i over (L - window, L] and
               the block's own keys, every block row seeing every other (no causal mask), with the sinks
    h        = collapse(streams, the last stage's ffn `pre`)            (V4.1 has no hc_head; pre-norm)
    logits_j = lm_head(norm(h_j)) + markov(prev_j),  markov(x) = head(embed(x)) (rank dspark_markov_rank)
               prev_0 = t, prev_j = draft_{j-1}: the low-rank Markov head conditions each position on the
               draft before it, so the block is sampled left to right after one parallel forward
    draft_j  = argmax logits_j                        (drafts are greedy here: see worker/dspark.py)
    conf_j   = confidence_head([h_j, embed(prev_j)])  a logit; DeepSpec cuts the block before the first
               position whose sigmoid is below its --confidence-threshold (0: keeps the whole block)

The embedding and the vocabulary head are the target's (DeepSpec trains frozen copies of them; the
release shares them). Block position j predicts the token at L + 2 + j, so a block of B gives B drafts
(verify width B + 1); fewer wanted are the block's first ones (every block row sees every other, so the
whole block always runs).

Tensor names, under `mtp.{i}.` (stage i < n; D hidden, hd head dim, r the Markov rank, V the vocabulary,
E draft experts of width I). A checkpoint may use the release's spellings instead, read as these:

| this project (`mtp.{i}.`)                        | DeepSpec (Qwen3 DSpark)        | release (`mtp.{i}.`)      |
| ------------------------------------------------ | ------------------------------ | ------------------------- |
| main_proj.weight [D, taps * D] (stage 0)         | fc.weight                      | main_proj.weight          |
| main_norm.weight [D] (stage 0)                   | hidden_norm.weight             | main_norm.weight          |
| block.self_attn.q_a_proj / q_a_norm / q_b_proj   | layers.{i}.self_attn.q_proj    | attn.wq_a / q_norm / wq_b |
| block.self_attn.kv_proj / kv_norm [hd, D], [hd]  | self_attn.k_proj, v_proj, k_norm | attn.wkv / kv_norm      |
| block.self_attn.o_a_proj / o_b_proj (grouped)    | self_attn.o_proj               | attn.wo_a / wo_b          |
| block.self_attn.sinks [heads]                    | (none)                         | attn.attn_sink            |
| block.mlp.gate.weight, .e_score_correction_bias(_vl) | (a dense mlp)              | ffn.gate.weight, .bias(_vl) |
| block.mlp.experts.gate_up_proj [E, 2I, D], down_proj [E, D, I] | -                | ffn.experts.{e}.w1, w3, w2 |
| block.mlp.shared_experts.gate_proj / up_proj / down_proj | -                      | ffn.shared_experts.w1 / w3 / w2 |
| block.input_layernorm / post_attention_layernorm | input_layernorm / post_attention_layernorm | attn_norm / ffn_norm |
| block.attn_hc / ffn_hc .fn, .base, .scale (mHC)  | (none: one residual stream)    | hc_attn_* / hc_ffn_*      |
| norm.weight [D] (stage n - 1)                    | norm.weight                    | norm.weight               |
| markov_head.embed.weight [V, r] (stage n - 1)    | markov_head.markov_w1.weight   | markov_head.embed.weight  |
| markov_head.head.weight [V, r] (stage n - 1)     | markov_head.markov_w2.weight   | markov_head.head.weight   |
| confidence_head.proj.weight [1, D + r] (.bias)   | confidence_head.proj.weight, .bias | confidence_head.proj.weight |

V4-Flash-0731 spells its layers' tensors as V4.1's release does (without the `_vl` bias), its heads so:

| this project (`mtp.{n - 1}.`)                              | V4-Flash-0731 (`mtp.{n - 1}.`)              |
| ---------------------------------------------------------- | ------------------------------------------- |
| hc_head.hc_fn [hc, hc * D], hc_head.hc_base [hc], .hc_scale [1] | hc_head_fn, hc_head_base, hc_head_scale |
| markov_head.embed.weight, markov_head.head.weight [V, r]   | markov_head.markov_w1.weight, markov_w2.weight |

config.json keys (the release's, in the target's config): num_nextn_predict_layers (the stages; DeepSpec's
num_draft_layers), dspark_block_size (block_size), dspark_noise_token_id (mask_token_id),
dspark_target_layer_ids (target_layer_ids), dspark_markov_rank (markov_rank, a "vanilla" head),
dspark_n_routed_experts / dspark_num_experts_per_tok (the stages' MoE; the target's when absent), and
the stages' compress_ratios after the layers' (0: sliding window only). A draft directory is such a
config.json with the `mtp.*` tensors: the release ships them inside the target's checkpoint, so the
target's own directory is one.

Weights stored FP8 (e4m3 with block scales, config.json's weight_block_size) or MXFP4 (routed experts)
are dequantized at load, or with `model.quantization: checkpoint` held as the target holds them
(models/loader.py): Fp8Linear and packed experts, run by the same kernels. `held_draft` builds that
form on the meta device and `ring_bytes` the proposer's rings: what `python -m server plan` counts.

V4-Flash-0731's draft (a V4 target; the checkpoint ships it inside, `mtp.0` .. `mtp.2`), as its own
`inference/model.py` computes it (Hugging Face deepseek-ai/DeepSeek-V4-Flash-0731, revision 7872f01b:
`Transformer.forward`'s `main_hiddens`, `DSparkBlock(Block)`, `DSparkAttention`, `forward_embed`,
`forward_head`). DeepSpec has no DeepSeek draft (Qwen3 and Gemma4 only), and that file is not in the
public code index; it is read here through public code that transcribes or ports it, which agrees on
every point used: a vLLM DSpark draft module (`DeepSeekV4DSparkDraft` / `DeepSeekV4DSparkLayer` over
vLLM's DeepseekV4DecoderLayer), Tenstorrent's pure-torch DSpark reference (`DSparkModel`, by its own
account a port of the checkpoint's inference/model.py DSpark classes), ModelCloud/GPTQModel's V4
MTP shell (`expected_deepseek_v4_mtp_checkpoint_keys`: transformers' DeepseekV4DecoderLayer stages and
DeepseekV4HyperHead), bojieli/OpenTallas' tiled transcription of the reference's `Transformer.forward`,
and a released-layout validator (PrismaQuant: 4,705 `mtp.*` tensors with their dtypes and shapes).
Where it differs from V4.1's:

    tap[p]   = concat over j of mean_hc(streams LEAVING target layer j, at p): `h = layer(h, ...)` then
               `main_hiddens.append(h.mean(dim=2))`; Flash taps [40, 41, 42], the last layer's output
               among them (models/model.py `taps_out`)
    stages   = V4 layers (`DSparkLayerV4`, models/model.py DecoderLayer's order): each mHC site collapses
               with its own pre; the attention normalizes each query head (weightless RMS), as V4's does;
               the MoE is top-k routed on score + gate bias (the stages' layer ids 43-45 pass the 3 hash
               layers: the checkpoint has `ffn.gate.bias`, no `tid2eid`), the target's 256 experts, top-6
    h        = hc_head of the last stage's own (pre = sigmoid(scale * (rms(flat streams) @ hc_head_fn) +
               base) + hc_eps, h = sum over streams of pre * stream: models/hyper.py HyperHead), then
               that stage's norm and the target's head; h (before the norm) feeds the confidence head

The embedding and the vocabulary head are the target's here too (`embed.weight`, `head.weight`; no `mtp.*`
copy). Its config.json says num_nextn_predict_layers 1 over the three stages (inference/config.json's
n_mtp_layers says 3; the 46 compress_ratios of 43 layers list them: `_stage_count`), dspark_block_size 5,
dspark_noise_token_id 128799, dspark_target_layer_ids [40, 41, 42], dspark_markov_rank 256, no
dspark_n_routed_experts. Stored: main_proj, the attention projections and the shared expert FP8 e4m3 with
ue8m0 `.scale` per 128 x 128, the routed experts MXFP4, norms and the Markov and confidence heads BF16,
mHC, hc_head, sinks and the gate bias F32. The reference's attention rounds each window key's non-rope
channels to fp8 (e4m3, a power-of-two scale per 64; its target layers' as its stages'); this project's V4
layers follow transformers' deepseek_v4, which does not round, and so do the V4 stages' keys. The block,
its positions, the rings, the Markov head and the confidence cut are V4.1's.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from kernels import fake_quant_fp8_ue8m0
from kernels.quant import MXFP4_BLOCK, quantize_fp8_blocks, quantize_mxfp4
from models.attention import add_attention_projections, attention_output
from models.config import MOE, SLIDING, ConfigError, ModelConfig
from models.config_v41 import text_config
from models.hyper import HyperConnection, HyperHead, collapse, merge_streams
from models.layers import Fp8Linear, RMSNorm, RotaryTable, apply_rope, project_pair, unweighted_rms_norm
from models.loader import (
    CheckpointError,
    TensorSource,
    WeightReader,
    assign_parameter,
    fp8_block,
    fp8_candidates,
    loaded_dtype,
    read_packed_experts,
    read_parameter,
    stored_fp8_linear,
    swap_in_fp8,
)
from models.moe import Experts, MoE
from models.parallel import SINGLE, TensorParallel, shard_of
from models.released_format import stored_fp8
from models.weight_names import ExpertParts, NameIndex, module_name


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark checkpoint's draft settings, checked against its target (`from_file`)."""

    stages: int  # draft layers (num_nextn_predict_layers)
    block_size: int  # drafts a block proposes (verify width block_size + 1)
    noise_token_id: int  # the block's filler after its first token (DeepSpec's mask token)
    tap_layers: tuple[int, ...]  # target layers whose attention input feeds main_proj, in order
    markov_rank: int
    layers: ModelConfig  # the stages as the layers of a model: sliding V4.1 layers with the draft MoE

    @classmethod
    def from_file(cls, path: str | Path, target: ModelConfig) -> "DSparkConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read the draft config: {exc}") from exc
        try:
            return cls.from_dict(raw, target)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target: ModelConfig) -> "DSparkConfig":
        d = text_config(raw)
        if not d.get("dspark_block_size"):
            raise ConfigError("no dspark_block_size: not a DSpark checkpoint")
        base = ModelConfig.from_dict(raw)
        differing = [key for key in ("hidden_size", "vocab_size", "hc_mult", "head_dim", "num_heads")
                     if getattr(base, key) != getattr(target, key)]
        if base.is_v41 != target.is_v41:
            differing.append("model_type")
        if differing:
            raise ConfigError(f"the draft does not fit the target model: its {', '.join(differing)} differ")
        stages, block = _stage_count(d, base), int(d["dspark_block_size"])
        taps = tuple(int(i) for i in d.get("dspark_target_layer_ids") or ())
        if stages < 1 or block < 1:
            raise ConfigError(f"num_nextn_predict_layers {stages} and dspark_block_size {block} must be >= 1")
        if not taps or list(taps) != sorted(set(taps)) or not all(0 <= i < target.num_layers for i in taps):
            raise ConfigError(f"dspark_target_layer_ids {list(taps)}: increasing layers of the target's "
                              f"{target.num_layers}")
        noise = d.get("dspark_noise_token_id")
        if not isinstance(noise, int) or not 0 <= noise < target.vocab_size:
            raise ConfigError(f"dspark_noise_token_id {noise!r} is not a token id below {target.vocab_size}")
        key, listed = _listed_after_layers(d, base)
        if any(listed[:stages]):
            raise ConfigError(f"{key} of the DSpark stages {listed[:stages]}: they attend a sliding window (0)")
        layers = replace(
            base, num_layers=stages, layer_types=(SLIDING,) * stages, compress_rates=(0,) * stages,
            mlp_layer_types=(MOE,) * stages, engram=None, shared_compression=None, mtp_layer_types=(),
            mtp_compress_rates=(),
            n_routed_experts=int(d.get("dspark_n_routed_experts") or base.n_routed_experts),
            num_experts_per_tok=int(d.get("dspark_num_experts_per_tok") or d.get("dspark_n_activated_experts")
                                    or base.num_experts_per_tok),
            simulate_quantization=target.simulate_quantization,
        )
        return cls(stages=stages, block_size=block, noise_token_id=noise, tap_layers=taps,
                   markov_rank=int(d.get("dspark_markov_rank", 256)), layers=layers)


def _stage_count(d: dict[str, Any], base: ModelConfig) -> int:
    """The draft's stages. V4.1: num_nextn_predict_layers. V4-Flash-0731's config.json says
    num_nextn_predict_layers 1 over three stages; its inference/config.json's n_mtp_layers, or the
    entries listed after the layers' in compress_ratios (46 for 43 layers), count them."""
    nextn = d.get("num_nextn_predict_layers") or 0
    if base.is_v41:
        return nextn
    return int(d.get("n_mtp_layers") or max(len(_listed_after_layers(d, base)[1]), nextn))


def _listed_after_layers(d: dict[str, Any], base: ModelConfig) -> tuple[str, list[int]]:
    """(the key, its entries past the layers' as compress ratios): the releases' compress_ratios, or on V4
    transformers' layer_types (a sliding layer 0, any other kind 1)."""
    n = base.num_layers
    if not base.is_v41 and d.get("compress_ratios") is None and d.get("layer_types") is not None:
        return "layer_types", [0 if kind == SLIDING else 1 for kind in d["layer_types"][n:]]
    return "compress_ratios", [int(r) for r in (d.get("compress_ratios") or [])[n:]]


@dataclass(frozen=True)
class BlockBatch:
    """One drafting step's blocks: N sequences of `block` rows each, sequence-major (row n * block + j is
    sequence n's block position j). A sequence's context is its slot's ring at positions [first, last]
    (within the window ending at `last`)."""

    token_ids: torch.Tensor  # [N * block] int64: each block's token, then noise tokens
    positions: torch.Tensor  # [N * block] int64: last + 1 ..
    slots: torch.Tensor  # [N] int64
    last: torch.Tensor  # [N] int64: the position of the last context row (the target's last kept row)
    first: torch.Tensor  # [N] int64: the first position the slot's ring holds for this sequence
    block: int

    @classmethod
    def build(cls, rows: list[tuple[int, int, int, int]], block: int, noise_token_id: int,
              device: torch.device | str) -> "BlockBatch":
        """rows: (slot, block token, last context position, first context position) per sequence."""
        tokens = [[token] + [noise_token_id] * (block - 1) for _, token, _, _ in rows]
        positions = [list(range(last + 1, last + 1 + block)) for _, _, last, _ in rows]

        def ints(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device)

        return cls(ints(tokens).flatten(), ints(positions).flatten(), ints([r[0] for r in rows]),
                   ints([r[2] for r in rows]), ints([r[3] for r in rows]), block)

    def context(self, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's ring rows [N, rows, hd] and which of them hold a context position: row r
        holds last - ((last - r) mod rows), a position of the window (last - rows, last], valid from
        `first` on."""
        width = ring.shape[1]
        rows = torch.arange(width, device=ring.device)[None, :]
        held = self.last[:, None] - (self.last[:, None] - rows) % width
        return ring[self.slots], held >= self.first[:, None]


def allocate_rings(config: DSparkConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
                   ) -> torch.Tensor:
    """The stages' context keys [stages, slots, sliding_window, head_dim]: position p of a slot's sequence
    at row p % sliding_window (the release's window cache; nothing else of a sequence is kept)."""
    c = config.layers
    return torch.zeros(config.stages, num_slots, c.sliding_window, c.head_dim, dtype=dtype, device=device)


def ring_bytes(config: DSparkConfig, num_slots: int, dtype: torch.dtype) -> int:
    """The bytes `allocate_rings` allocates for `num_slots` (its tensor on the meta device): what the
    proposer holds beside the target's cache, and what `python -m server plan` counts for it."""
    rings = allocate_rings(config, num_slots, dtype, "meta")
    return rings.numel() * rings.element_size()


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


class DSparkAttention(nn.Module):
    """A sliding-window attention (V4.1's, or on a V4 target V4's) whose keys (= values) are the context's,
    made from main_x, and the block's own; the block's rows attend both, every row every block row. V4's
    normalizes each query head (weightless RMS, models/attention.py); V4.1's rounds the keys to fp8 with
    its simulated formats, V4's keys are not rounded (as the V4 layers' are not)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.head_dim, self.tp, self.eps = config.head_dim, tp, config.rms_norm_eps
        self.num_heads = add_attention_projections(self, config, tp)
        self.rope = RotaryTable(config.main_rope)  # window-only: the plain rope, no YaRN
        v41 = config.is_v41
        self.quantize_kv = fake_quant_fp8_ue8m0 if v41 and config.simulate_quantization else _unchanged
        self.normalize_q = _unchanged if v41 else self._query_heads_normalized

    def _query_heads_normalized(self, q: torch.Tensor) -> torch.Tensor:
        return unweighted_rms_norm(q, self.eps)

    def context_keys(self, main: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[R, D] projected taps at `positions` -> their keys [R, head_dim], roped (and on V4.1 fp8-rounded)."""
        cos, sin = self.rope(positions)
        return self.quantize_kv(apply_rope(self.kv_norm(self.kv_proj(main)), cos, sin))

    def forward(self, x: torch.Tensor, batch: BlockBatch, ring: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(batch.positions)
        n, block = batch.slots.shape[0], batch.block
        q_low, kv = project_pair(x, self.q_a_proj, self.kv_proj)
        q = self.q_b_proj(self.q_a_norm(q_low)).view(n * block, self.num_heads, self.head_dim)
        q = apply_rope(self.normalize_q(q), cos, sin).view(n, block, self.num_heads, self.head_dim)
        own = self.quantize_kv(apply_rope(self.kv_norm(kv), cos, sin)).view(n, block, -1)
        context, valid = batch.context(ring)
        keys = torch.cat([context.to(own.dtype), own], dim=1).float()
        valid = torch.cat([valid, valid.new_ones(n, block)], dim=1)
        scores = torch.einsum("nbhd,nkd->nhbk", q.float(), keys) * self.head_dim**-0.5
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        sinks = self.sinks.float()[None, :, None, None].expand(n, -1, block, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("nhbk,nkd->nbhd", probs, keys).to(x.dtype).flatten(0, 1)
        return attention_output(self, out, cos, sin)


class DSparkLayer(nn.Module):
    """A stage's V4.1 layer: single-pass mHC around DSpark attention and the draft MoE (no Engram)."""

    def __init__(self, config: ModelConfig, stage: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config, tp)
        self.mlp = MoE(config, stage, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, batch: BlockBatch, ring: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [T, hc, D], incoming pre [T, hc]) -> (streams, this layer's ffn pre)."""
        attn_pre, post, comb, x = self.attn_hc.site(streams, self.input_layernorm, collapse_pre=pre)
        out = self.self_attn(x, batch, ring)
        streams = merge_streams(streams, post, comb, out)
        ffn_pre, post, comb, x = self.ffn_hc.site(streams, self.post_attention_layernorm, collapse_pre=attn_pre)
        out = self.mlp(x, batch.token_ids)
        return merge_streams(streams, post, comb, out), ffn_pre


class DSparkLayerV4(DSparkLayer):
    """A stage's V4 layer (V4-Flash-0731's draft): the same modules, in models/model.py DecoderLayer's
    order, each mHC site collapsing with its own pre, around DSpark attention and the draft MoE (top-k
    routed: the stages continue the layer ids past the hash layers, and the release gives them a gate
    bias, no tid2eid)."""

    def forward(self, streams: torch.Tensor, pre: torch.Tensor | None, batch: BlockBatch, ring: torch.Tensor
                ) -> tuple[torch.Tensor, None]:
        """(streams [T, hc, D], unused) -> (streams, None): a V4 layer hands no pre to the next."""
        post, comb, x = self.attn_hc(streams, self.input_layernorm)
        out = self.self_attn(x, batch, ring)
        streams = merge_streams(streams, post, comb, out)
        post, comb, x = self.ffn_hc(streams, self.post_attention_layernorm)
        out = self.mlp(x, batch.token_ids)
        return merge_streams(streams, post, comb, out), None


class MarkovHead(nn.Module):
    """Low-rank bigram logits: head(embed(previous token)), float32 (the release keeps its head so)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """previous [N] -> (logit bias [N, V] float32, the previous tokens' embeddings [N, r])."""
        embedded = self.embed(previous)
        return F.linear(embedded.float(), self.head.weight.float()), embedded


class ConfidenceHead(nn.Module):
    """One logit per block position from [h_j, markov embedding of prev_j]: DeepSpec trains its sigmoid on
    the position's expected acceptance (1 - total variation between the draft and target distributions)."""

    def __init__(self, features: int, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(features, 1, bias=bias)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1).float()
        return F.linear(features, self.proj.weight.float(),
                        None if self.proj.bias is None else self.proj.bias.float()).squeeze(-1)


class DSparkStage(nn.Module):
    """Stage `index`: its layer (`block`: V4.1's, or V4's for a V4 target), and the first stage's tap
    projection or the last's heads (on V4 with its own hc_head)."""

    def __init__(self, config: DSparkConfig, index: int, tp: TensorParallel, confidence_bias: bool) -> None:
        super().__init__()
        c = config.layers
        self.block = (DSparkLayer if c.is_v41 else DSparkLayerV4)(c, index, tp)
        self.hc_head = None
        if index == 0:
            self.main_proj = nn.Linear(len(config.tap_layers) * c.hidden_size, c.hidden_size, bias=False)
            self.main_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if index == config.stages - 1:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, config.markov_rank)
            self.confidence_head = ConfidenceHead(c.hidden_size + config.markov_rank, confidence_bias)
            if not c.is_v41:
                self.hc_head = HyperHead(c)

    def collapse(self, streams: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """The last stage's streams [T, hc, D] -> [T, D]: V4's hc_head, or V4.1's collapse by the last ffn
        pre (V4.1 has no hc_head)."""
        return collapse(pre, streams) if self.hc_head is None else self.hc_head(streams)


@dataclass(frozen=True)
class DraftedBlocks:
    tokens: torch.Tensor  # [N, block] int64: the greedy drafts
    logits: torch.Tensor  # [N, block, V] float32: each position's logits with its Markov bias
    confidence: torch.Tensor  # [N, block] float32 logits of the confidence head


def confident_lengths(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSpec's cut: per row of confidence logits [N, k], the positions before the first whose sigmoid
    is below `threshold` (all k with threshold 0)."""
    below = torch.sigmoid(confidence) < threshold
    whole = torch.full_like(below[:, 0], confidence.shape[1], dtype=torch.long)
    return torch.where(below.any(dim=1), below.int().argmax(dim=1), whole)


class DSparkDraft(nn.Module):
    """The stages (`mtp.{i}`), with the target's embedding and head (kept, not registered: they are the
    target's parameters). Sequences' context lives in rings the caller owns (`allocate_rings`)."""

    def __init__(self, config: DSparkConfig, embed: nn.Module, head: nn.Module, tp: TensorParallel = SINGLE,
                 confidence_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        self.mtp = nn.ModuleList(DSparkStage(config, i, tp, confidence_bias) for i in range(config.stages))
        self.shared = (embed, head)

    @torch.inference_mode()
    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      rings: torch.Tensor) -> None:
        """Context rows: `taps` [R, taps, D] at `positions` of `slots` (one row per (slot, ring row): the
        caller writes a slot's last `sliding_window` rows at most) -> every stage's ring."""
        first = self.mtp[0]
        main = first.main_norm(first.main_proj(taps.flatten(1)))
        rows = positions % rings.shape[2]
        for index, stage in enumerate(self.mtp):
            rings[index, slots, rows] = stage.block.self_attn.context_keys(main, positions).to(rings.dtype)

    @torch.inference_mode()
    def draft(self, batch: BlockBatch, rings: torch.Tensor) -> DraftedBlocks:
        """Every sequence's block through the stages, then the Markov-corrected greedy drafts left to
        right and the confidence of each position."""
        embed, head = self.shared
        hc = self.config.layers.hc_mult
        streams = embed(batch.token_ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = torch.zeros(streams.shape[0], hc, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        for index, stage in enumerate(self.mtp):
            streams, pre = stage.block(streams, pre, batch, rings[index])
        last = self.mtp[-1]
        n, block = batch.slots.shape[0], batch.block
        hidden = last.collapse(streams, pre)
        base = head(last.norm(hidden)).float().view(n, block, -1)
        previous = batch.token_ids.view(n, block)[:, 0]
        tokens, logits, embedded = [], [], []
        for j in range(block):
            bias, previous_embedded = last.markov_head(previous)
            logits.append(base[:, j] + bias)
            embedded.append(previous_embedded)
            previous = logits[-1].argmax(dim=-1)
            tokens.append(previous)
        confidence = last.confidence_head(hidden.view(n, block, -1), torch.stack(embedded, dim=1))
        return DraftedBlocks(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), confidence)


# -- loading -------------------------------------------------------------------------------------------
_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_OWN = ("main_proj.", "main_norm.", "norm.", "markov_head.", "confidence_head.", "hc_head.", "block.")
_EXPERT_PART = re.compile(r"^(mtp\.\d+\.block\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_OWN_RENAMES = [  # V4-Flash-0731's (and DeepSpec's) spellings of the heads' tensors
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
    (re.compile(r"^markov_head\.markov_w1\."), "markov_head.embed."),
    (re.compile(r"^markov_head\.markov_w2\."), "markov_head.head."),
]


def draft_module_name(stored: str) -> str:
    """A stored `mtp.{i}.*` name -> this module's: its own names as they are (V4-Flash-0731's hc_head_fn
    and markov_w1 / markov_w2 renamed); the release's layer names (`attn.wq_a`, `ffn.experts.3.w1`,
    `hc_attn_fn`, ...) renamed as a layer's are, under `block.`."""
    index, rest = _STAGE.match(stored).groups()
    for pattern, replacement in _OWN_RENAMES:
        rest = pattern.sub(replacement, rest)
    if rest.startswith(_OWN):
        return f"mtp.{index}.{rest}"
    renamed = module_name(f"layers.{index}.{rest}").removeprefix(f"model.layers.{index}.")
    renamed = re.sub(r"\.gate\.bias_vl$", ".gate.e_score_correction_bias_vl", renamed)
    return f"mtp.{index}.block.{renamed}"


def draft_names(stored: set[str]) -> NameIndex:
    """The loader's name index over a directory's `mtp.*` tensors (per-expert matrices to be stacked)."""
    direct: dict[str, str] = {}
    experts: dict[str, ExpertParts] = defaultdict(ExpertParts)
    for name in sorted(n for n in stored if _STAGE.match(n)):
        module = draft_module_name(name)
        match = _EXPERT_PART.match(module)
        if match:
            experts[match.group(1)].by_expert[int(match.group(2))][match.group(3)] = name
        else:
            direct.setdefault(module, name)
    return NameIndex(direct=direct, experts=dict(experts))


# The heads read their weights directly, in float32 (the release keeps them so): never held as Fp8Linear.
FLOAT32_HEADS = ("markov_head.", "confidence_head.")


def held_dtype(name: str, dtype: torch.dtype, stored: torch.dtype) -> torch.dtype:
    """The dtype a dense draft tensor is held in: the loader's rule (float32 norms, mHC, sinks and biases,
    `dtype` otherwise), the heads float32."""
    return loaded_dtype(name, torch.float32 if any(h in name for h in FLOAT32_HEADS) else dtype, stored)


def stored_fp8_in_draft(name: str) -> bool:
    """Whether the release stores draft weight `name` as block-scaled FP8: the target's layers' list
    (models/released_format.py: attention projections, shared expert) and main_proj, a linear of the
    draft as e_proj / h_proj are of V4's MTP layer."""
    return stored_fp8(name) or name.endswith(".main_proj.weight")


def fp8_linear_candidates(draft: DSparkDraft) -> list[tuple[str, nn.Linear]]:
    """The draft's linears that may be held as Fp8Linear (the loader's candidates but the heads)."""
    return [(name, linear) for name, linear in fp8_candidates(draft)
            if not any(h in f"{name}." for h in FLOAT32_HEADS)]


def held_draft(config: DSparkConfig, fp8: int | None = None, packed_experts: bool = False) -> DSparkDraft:
    """The whole draft on the meta device in the form `load_dspark(keep_quantized=True)` holds a
    checkpoint in the release's formats: the linears the release stores FP8 (`stored_fp8_in_draft`) as
    Fp8Linear of `fp8` x `fp8` blocks (None: none), the routed experts as MXFP4 codes and exponents when
    `packed_experts`; the rest as load_dspark holds it (as the target's). The confidence head without a bias, as the release has it. What `python -m server
    plan` counts (engine/plan_weights.py)."""
    with torch.device("meta"):
        draft = DSparkDraft(config, nn.Identity(), nn.Identity())
    if fp8:
        for name, _ in fp8_linear_candidates(draft):
            if stored_fp8_in_draft(f"{name}.weight"):
                swap_in_fp8(draft, name, fp8)
    if packed_experts:
        for experts in [m for m in draft.modules() if isinstance(m, Experts)]:
            for leaf in ("gate_up_proj", "down_proj"):
                held, rows, cols = experts.weights(leaf).shape
                experts.keep_packed(leaf, torch.empty(held, rows, cols // 2, dtype=torch.uint8, device="meta"),
                                    torch.empty(held, rows, cols // MXFP4_BLOCK, dtype=torch.uint8, device="meta"))
    return draft


def held_tensor_bytes(draft: DSparkDraft, dtype: torch.dtype) -> list[tuple[str, int]]:
    """(name, bytes) of each of the draft's parameters and buffers as load_dspark holds them in `dtype`
    (on any device, the meta device included): Fp8Linear values and float32 scales, MXFP4 codes and
    exponents as they are, the rest by `held_dtype`."""
    fp8 = {name for name, module in draft.named_modules() if isinstance(module, Fp8Linear)}
    out = []
    for name, tensor in list(draft.named_parameters()) + list(draft.named_buffers()):
        held = tensor.dtype if name.rpartition(".")[0] in fp8 else held_dtype(name, dtype, tensor.dtype)
        out.append((name, tensor.numel() * held.itemsize))
    return out


def load_dspark(directory: str | Path, target: nn.Module, tp: TensorParallel = SINGLE,
                keep_quantized: bool = False) -> DSparkDraft:
    """The draft of `directory` (config.json with the dspark keys, `mtp.*` tensors in its safetensors; other
    tensors there, such as a whole target's, are not read) for `target`, on its device and in its dtype
    (the Markov and confidence heads in float32, as the release keeps them). FP8 and MXFP4 tensors are
    dequantized, or with `keep_quantized` (`model.quantization: checkpoint`) held as the target holds
    them (models/loader.py): FP8 linears as Fp8Linear, MXFP4 routed experts packed. ConfigError for a
    directory that is not a DSpark checkpoint of this target, CheckpointError for missing or surplus
    `mtp.*` tensors."""
    directory = Path(directory)
    config = DSparkConfig.from_file(directory / "config.json", target.config)
    source = TensorSource(directory)
    index = draft_names(source.names())
    bias = any(name.endswith("confidence_head.proj.bias") for name in index.direct)
    with torch.device("meta"):
        draft = DSparkDraft(config, target.model.embed_tokens, target.lm_head, tp, confidence_bias=bias)
    reader = WeightReader(source, fp8_block(directory / "config.json"))
    fp8_modules = _hold_fp8(draft, reader, index) if keep_quantized else set()
    dtype, device = target.lm_head.weight.dtype, target.lm_head.weight.device
    for name, tensor in list(draft.named_parameters()) + list(draft.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        shard = shard_of(draft, name)
        if owner in fp8_modules:
            if leaf == "weight":  # its weight_scale comes with it
                values, scale = reader.read_stored(index.direct.get(name, name), tensor.shape, shard, "fp8")
                assign_parameter(draft, name, values.to(device))
                assign_parameter(draft, f"{owner}.weight_scale", scale.to(device))
            continue
        module = draft.get_submodule(owner)
        packed = None
        if keep_quantized and isinstance(module, Experts):
            packed = read_packed_experts(reader, index, name, tensor.shape, shard)
        if packed is not None:
            module.keep_packed(leaf, packed[0].to(device), packed[1].to(device))
            continue
        value = read_parameter(reader, index, name, tensor.shape, shard)
        assign_parameter(draft, name, value.to(device=device, dtype=held_dtype(name, dtype, value.dtype)))
    surplus = sorted(name for name in source.names() - reader.consumed if _STAGE.match(name))
    if surplus:
        raise CheckpointError(f"{directory}: DSpark tensors the draft does not use: {', '.join(surplus[:5])}")
    return draft.eval()


def _hold_fp8(draft: DSparkDraft, reader: WeightReader, index: NameIndex) -> set[str]:
    """Puts an Fp8Linear where each candidate linear stands whose checkpoint weight is FP8 (and whose
    shard, if any, cuts whole blocks), as the loader does for the target; returns their names."""
    held = set()
    for name, linear in fp8_linear_candidates(draft):
        stored = index.direct.get(f"{name}.weight", f"{name}.weight")
        if stored in reader.source.names() and stored_fp8_linear(reader, stored, linear, shard_of(draft, f"{name}.weight")):
            swap_in_fp8(draft, name, reader.fp8_block)
            held.add(name)
    return held


def attach_dspark(model: nn.Module, directory: str | Path, tp: TensorParallel = SINGLE,
                  keep_quantized: bool = False) -> DSparkDraft:
    """Loads the draft of `directory` as `model.dspark` (a submodule: its weights count with the model's)."""
    model.dspark = load_dspark(directory, model, tp, keep_quantized)
    return model.dspark


# -- the tiny test draft -------------------------------------------------------------------------------
def tiny_dspark_keys(target: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """The dspark keys of a tiny draft for `target` (the releases' shape: 3 stages, a block of 5, the
    last three layers tapped; for V4.1 fewer draft experts than the target's, top-3, for V4 the target's
    as V4-Flash-0731's); overrides replace keys. num_nextn_predict_layers counts the stages here."""
    keys = {
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": target.vocab_size - 1,
        "dspark_target_layer_ids": list(range(max(0, target.num_layers - 3), target.num_layers)),
        "dspark_markov_rank": 32,
    }
    if target.is_v41:
        keys.update(dspark_n_routed_experts=4, dspark_num_experts_per_tok=3)
    keys.update(overrides)
    return keys


def _list_stages(raw: dict[str, Any], target: ModelConfig, stages: int) -> None:
    """Lists the stages as sliding layers after the target's, in the key its config.json spells the layers
    with; on V4 with num_nextn_predict_layers 1, as V4-Flash-0731's config.json does."""
    if not target.is_v41 and raw.get("compress_ratios") is None and raw.get("layer_types") is not None:
        raw["layer_types"] = list(target.layer_types) + [SLIDING] * stages
    else:
        raw["compress_ratios"] = list(target.compress_rates) + [0] * stages
    if not target.is_v41:
        raw["num_nextn_predict_layers"] = 1


def build_tiny_dspark(out: str | Path, target_dir: str | Path, seed: int = 0, fp8: int | None = None,
                      **overrides: Any) -> Path:
    """Writes a DSpark draft for the checkpoint in `target_dir` (V4.1, or V4 as V4-Flash-0731's) into
    `out`: its config.json with the dspark keys (`tiny_dspark_keys`, `overrides` replacing them) and the
    stages listed after the layers (`_list_stages`), and seeded random `mtp.*` weights
    (models/random_model.py's rule, this project's names) in model.safetensors. With `fp8` (a block
    side), in the release's formats (`stored_as_released`) with config.json's quantization_config."""
    from models.random_model import random_tensor

    out, target_dir = Path(out), Path(target_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((target_dir / "config.json").read_text())
    target = ModelConfig.from_dict(raw)
    raw.update(tiny_dspark_keys(target, **overrides))
    _list_stages(raw, target, raw["num_nextn_predict_layers"])
    config = DSparkConfig.from_dict(raw, target)
    with torch.device("meta"):
        draft = DSparkDraft(config, nn.Identity(), nn.Identity())
    generator = torch.Generator().manual_seed(seed)
    weights = {name: random_tensor(name, tensor.shape, config.layers.n_routed_experts, generator).contiguous()
               for name, tensor in list(draft.named_parameters()) + list(draft.named_buffers())}
    if fp8:
        weights = stored_as_released(weights, fp8)
        raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [fp8, fp8], "expert_dtype": "fp4"}
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def stored_as_released(weights: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """A draft's dense tensors (this project's names) in the release's formats: the weights it stores FP8
    (`stored_fp8_in_draft`) as float8_e4m3fn with float32 `_scale_inv` per `block` x `block` tile
    (kernels/quant.py quantize_fp8_blocks), the stacked routed experts as MXFP4 codes with `_scale`
    exponents per 32 (quantize_mxfp4); the rest as they are."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name], out[f"{name}_scale"] = quantize_mxfp4(tensor)
        elif stored_fp8_in_draft(name) and tensor.dim() == 2:
            out[name], out[f"{name}_scale_inv"] = quantize_fp8_blocks(tensor, block)
        else:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}
