"""Mixture of experts: routed experts (top-k or hash routing) plus a shared expert.

Scores are score_fn(router logits) (`sqrtsoftplus` in V4); top-k picks on score + correction bias
but weights use the plain scores, renormalised over the chosen experts and scaled by
`routed_scaling_factor`. Hash layers take the experts from a frozen token-id table instead. Both
SwiGLU paths clamp: gate from above, up on both sides, at `swiglu_limit`.
V4.1 differences: the router runs in float32 on logits divided by `gate_temp`, renormalises only when
`norm_topk_prob` and top_k > 1, applies each expert's weight before its down projection, and sizes the
shared expert at `moe_intermediate_size` whatever `n_shared_experts` says.

Tensor parallel (expert parallel inside the TP group): the router stays replicated, so every rank
routes every token alike; each rank holds an equal run of the routed experts and computes them for
all tokens that chose them, and the shared expert is cut column / row parallel (its gate and up rows,
its down columns). Each rank's float32 sum is partial: one all-reduce per layer completes it.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.batch_invariant import batch_invariant_active
from kernels.moe import (
    ExpertWeights,
    MXFP4Experts,
    clamped_swiglu,
    experts_on_device,
    experts_reference,
    grouped_mm_supported,
)
from kernels.mma_layout import MXFP4MMAExperts, mma_layout, small_scales
from kernels.moe_mxfp4_mma import supported
from kernels.router import SCORE_FUNCTIONS, route
from models.config import HASH_MOE, ModelConfig
from models.layers import TakesFp8Prefill, project_pair
from models.parallel import SINGLE, TensorParallel, mark_shards


class Router(nn.Module):
    def __init__(self, config: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.hashed = config.num_experts_per_tok, hashed
        self.scale = config.routed_scaling_factor
        self.temperature = config.gate_temp
        self.renormalize = not config.is_v41 or (config.norm_topk_prob and self.top_k > 1)
        if config.scoring_func not in SCORE_FUNCTIONS:
            raise ValueError(f"scoring_func {config.scoring_func!r}: choose from {', '.join(SCORE_FUNCTIONS)}")
        self.score_name = config.scoring_func
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
            if config.is_v41:  # V4.1's bias for image tokens: loaded with the checkpoint, unused for text
                self.register_buffer(
                    "e_score_correction_bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32)
                )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k], expert ids [T, k]) (kernels/router.py)."""
        bias = None if self.hashed else self.e_score_correction_bias
        return route(x, self.weight, token_ids, self.top_k, self.temperature, self.scale, self.renormalize,
                     self.score_name, bias, self.tid2eid if self.hashed else None)


LEAVES = ("gate_up_proj", "down_proj")


def lay_out_experts_for_mma(model: nn.Module) -> int:
    """`Experts.lay_out_for_mma` on every routed-experts module of `model` (drafts included); how many
    are laid out. The runner calls it for a bf16 model on the GPU: the CUDA decode kernel reads its
    weights ~1.3x faster than the Triton kernels (BENCHMARKS.md, seventeenth session), and the sorted
    prefill kernels read the same layout."""
    return sum(module.lay_out_for_mma() for module in model.modules() if isinstance(module, Experts))


class Experts(nn.Module, TakesFp8Prefill):
    """Routed experts stored as [E, 2I, D] (gate rows then up rows) and [E, D, I]; this rank's run of
    them (experts [first, first + held)) under tensor parallelism."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        shard = tp.shard("n_routed_experts", config.n_routed_experts)
        e, d, i = shard.size, config.hidden_size, config.moe_intermediate_size
        self.first, self.held = shard.start, shard.size
        self.limit = config.swiglu_limit
        self.weight_before_down = config.is_v41
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        mark_shards(self, gate_up_proj=shard, down_proj=shard)
        # per leaf, once its packed codes are laid out for kernels/moe_mxfp4_mma.py (`lay_out_for_mma`):
        # kernels/mma_layout.py's `small_scales` of its scales
        self.small_scales: dict[str, bool] = {}

    def keep_packed(self, leaf: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Holds `leaf` (gate_up_proj / down_proj) as released MXFP4 (codes [E, rows, cols / 2], E8M0
        exponents [E, rows, cols / 32]) instead of a dequantized parameter (model.quantization: checkpoint)."""
        del self._parameters[leaf]
        self.register_buffer(f"{leaf}_codes", codes)
        self.register_buffer(f"{leaf}_scales", scales)

    @property
    def mma_layout(self) -> bool:
        """Whether the packed codes are laid out for the CUDA decode kernel."""
        return bool(self.small_scales)

    def weights(self, leaf: str) -> ExpertWeights:
        if leaf in self._parameters:
            return self._parameters[leaf]
        codes, scales = self._buffers[f"{leaf}_codes"], self._buffers[f"{leaf}_scales"]
        if self.mma_layout:
            return MXFP4MMAExperts(codes, scales, self.small_scales[leaf])
        return MXFP4Experts(codes, scales)

    def lay_out_for_mma(self) -> bool:
        """Re-lays the packed MXFP4 codes, in their own storage, for the CUDA decode kernel
        (kernels/moe_mxfp4_mma.py) where it runs for both projections; whether they are now so laid out.
        Idempotent; dense weights stay as they are."""
        if self.mma_layout:
            return True
        if any(f"{leaf}_codes" not in self._buffers for leaf in LEAVES):
            return False
        shapes = [self.weights(leaf).shape for leaf in LEAVES]
        if not all(supported(self._buffers["gate_up_proj_codes"].device, rows, cols) for _, rows, cols in shapes):
            return False
        for leaf in LEAVES:
            self._buffers[f"{leaf}_codes"] = mma_layout(self._buffers[f"{leaf}_codes"], in_place=True)
            self.small_scales[leaf] = small_scales(self._buffers[f"{leaf}_scales"])
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted sum of this rank's experts for every token (zero where it chose none of them) in
        float32, or with `residual` added in its dtype (`run_experts`)."""
        return run_experts(x, weights, experts, self.weights("gate_up_proj"), self.weights("down_proj"), self.first,
                           self.limit, self.weight_before_down, residual, fp8_prefill=self.fp8_prefill)


def run_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: ExpertWeights,
                down: ExpertWeights, first: int, limit: float, weight_before_down: bool,
                residual: torch.Tensor | None = None, fp8_prefill: bool = False) -> torch.Tensor:
    """kernels/moe.py's experts contract on the path this device and mode take: Triton or grouped GEMMs
    on the GPU (no host sync, capturable; prefill chunks of MXFP4 experts with FP8 activations where
    `fp8_prefill`), the reference loop on the CPU and in deterministic mode (whose batch-invariant GEMMs
    it goes through)."""
    if x.is_cuda and grouped_mm_supported(x) and not batch_invariant_active():
        return experts_on_device(x, weights, experts, gate_up, down, first, limit, weight_before_down, residual,
                                 fp8_prefill=fp8_prefill)
    return experts_reference(x, weights, experts, gate_up, down, first, limit, weight_before_down, residual)



class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d, i = config.hidden_size, config.moe_intermediate_size * (1 if config.is_v41 else config.n_shared_experts)
        name = "the shared expert's intermediate size (moe_intermediate_size x n_shared_experts)"
        rows, columns = tp.shard(name, i), tp.shard(name, i, dim=1)
        self.limit = config.swiglu_limit
        self.gate_proj = mark_shards(nn.Linear(d, rows.size, bias=False), weight=rows)
        self.up_proj = mark_shards(nn.Linear(d, rows.size, bias=False), weight=rows)
        self.down_proj = mark_shards(nn.Linear(rows.size, d, bias=False), weight=columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(*project_pair(x, self.gate_proj, self.up_proj), self.limit))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config, tp)
        self.shared_experts = SharedExpert(config, tp)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Routed plus shared experts in float32, cast to x's dtype after the all-reduce; on one rank
        the routed experts' last kernel adds the shared expert's output and casts (kernels/moe_pairs.py)."""
        weights, experts = self.gate(x, token_ids)
        shared = self.shared_experts(x)
        if self.tp.world_size == 1:
            return self.experts(x, weights, experts, residual=shared).to(x.dtype)
        out = self.experts(x, weights, experts) + shared.float()
        return self.tp.all_reduce(out).to(x.dtype)
