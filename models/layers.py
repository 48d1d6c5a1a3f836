"""Small building blocks shared by the DeepSeek-V4 layers: RMS norms, interleaved RoPE, grouped and FP8 linears."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from kernels.fp8_linear import fp8_grouped_linear, fp8_linear, fp8_linear_pair, grouped_product
from kernels.norm import rms_norm
from kernels.quant import FP8_BLOCK
from kernels.rope import apply_rope, apply_rope_, rope_table  # noqa: F401  (the models' import point)
from models.config import RopeSpec


class RMSNorm(nn.Module):
    """RMS norm whose weight stays float32 (as released); the product is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GroupedLinear(nn.Module):
    """Block-diagonal projection (attention's o_a_proj): each of `groups` runs of the input's columns gets
    its own [out_features / groups, in_features] map; `in_features` is one group's width."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_product(x, self.weight, self.groups)


class TakesFp8Prefill:
    """A module that can take e4m3 activations for prefill-sized inputs (`fp8_prefill`, off unless
    `prefill_in_fp8` turns it on): FP8 linears and routed experts."""

    fp8_prefill: bool = False


def prefill_in_fp8(model: nn.Module) -> int:
    """`model.prefill_activations: fp8`: every module of `model` that can (TakesFp8Prefill: routed
    experts, drafts' included, through kernels/moe_mxfp4_fp8.py; FP8 linears of 128 blocks through
    kernels/fp8_linear.py's scaled-mm path) takes e4m3 activations for prefill-sized inputs, as
    DeepSeek's own inference runs the release; decode keeps the model dtype. How many were switched."""
    switched = [module for module in model.modules() if isinstance(module, TakesFp8Prefill)]
    for module in switched:
        module.fp8_prefill = True
    return len(switched)


class Fp8Linear(nn.Module, TakesFp8Prefill):
    """A linear layer (no bias) whose weight stays as released, float8_e4m3fn values with one float32
    scale per `block` x `block` tile (`model.quantization: checkpoint`): the loader puts it where an
    nn.Linear or a GroupedLinear (`groups` > 1; `in_features` one group's width) stood and the checkpoint
    stores FP8. Half the bytes a bf16 weight reads per step."""

    def __init__(self, in_features: int, out_features: int, block: int = FP8_BLOCK, groups: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.groups = in_features, out_features, block, groups
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty(-(-out_features // block), -(-in_features // block)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups > 1:
            return fp8_grouped_linear(x, self.weight, self.weight_scale, self.groups, self.block)
        return fp8_linear(x, self.weight, self.weight_scale, self.block, fp8_activations=self.fp8_prefill)


def project_pair(x: torch.Tensor, first: nn.Module, second: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for two projections of the same x (attention's q_a and kv, a shared
    expert's gate and up): where both hold released FP8 of one block size, one kernel launch for the
    two (`fp8_linear_pair`; at a batch of 1 a launch's latency is most of a small projection's time);
    otherwise each on its own."""
    if (isinstance(first, Fp8Linear) and isinstance(second, Fp8Linear) and first.block == second.block
            and first.groups == second.groups == 1):
        return fp8_linear_pair(x, (first.weight, first.weight_scale), (second.weight, second.weight_scale), first.block)
    return first(x), second(x)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, None, eps)


_STEP_TABLES: ContextVar[dict | None] = ContextVar("rope_step_tables", default=None)


@contextmanager
def rope_step() -> Iterator[None]:
    """Within it, every RotaryTable of one spec computes cos / sin once per positions tensor: a model's
    forward or decode step enters it, so its layers share the tables of their rope kind (two kinds for
    V4's 43 layers: ~6 launches a layer saved) instead of each recomputing the same values. Scoped to
    one call, so no step ever sees another's (a CUDA graph captures the first layer's computation and
    the later layers' reads of it); outside it each call computes its own, as before."""
    token = _STEP_TABLES.set({})
    try:
        yield
    finally:
        _STEP_TABLES.reset(token)


class RotaryTable:
    """cos / sin for one rope kind, computed for the positions of a step (one row per position)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.spec = spec
        self.inv_freq = spec.inv_freq()
        self.scale = spec.attention_factor
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, rate: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin of `positions` rounded down to multiples of `rate` (a compressed entry's position:
        the rounding is the table kernel's, so the layers of one rate share a table)."""
        shared = _STEP_TABLES.get()
        if shared is None:
            return self._compute(positions, rate)
        # keyed by the tensor object, which the entry keeps alive: its id cannot be reused in the step
        key = (self.spec, id(positions), positions.device, rate)
        entry = shared.get(key)
        if entry is None or entry[0] is not positions:
            entry = shared[key] = (positions, *self._compute(positions, rate))
        return entry[1], entry[2]

    def _compute(self, positions: torch.Tensor, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_table(positions, self._inv_freq_on(positions.device), self.scale, rate)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The frequencies copied to the device once: a host-to-device copy per call would sync each
        step and cannot be captured in a CUDA graph."""
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]


def logits_into(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """float32 logits, copied into the caller's buffer when one is given."""
    if out is None:
        return logits.float()
    return out.copy_(logits)
