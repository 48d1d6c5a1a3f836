"""Routed experts of a MoE layer: the weighted sum of each token's chosen experts' SwiGLU MLPs.

Two paths compute the same sum:
- `experts_reference`: a loop over the experts the batch chose (the plain torch reference). It asks
  the host which experts were chosen, so it syncs and cannot be captured in a CUDA graph.
- `experts_grouped`: the (token, expert) pairs sorted by expert and run as two grouped GEMMs
  (`torch._grouped_mm`: CUTLASS on sm90+ GPUs, a loop on CPU), with the group offsets computed on the
  device. Shapes depend only on the batch size, so it never syncs and a decode step using it can be
  captured. Each token's k products are summed in slot order (not by atomics), so it is deterministic.
Experts outside this rank's run [first, first + held) contribute zero (tensor parallel: another rank
holds them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """CUDA's grouped GEMM takes bf16 only (and sm90+); the CPU fallback takes any float dtype."""
    if x.device.type == "cpu":
        return True
    return x.dtype == torch.bfloat16 and _capability(x.device.index or 0) >= 9


@functools.cache
def _capability(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


def experts_reference(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
) -> torch.Tensor:
    """x [T, D], weights / experts [T, k], gate_up [E, 2I, D], down [E, D, I] -> float32 [T, D]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    held = gate_up.shape[0]
    for expert in torch.unique(experts).tolist():
        local = expert - first
        if not 0 <= local < held:  # another rank's expert
            continue
        token_rows, slot = torch.where(experts == expert)
        weight = weights[token_rows, slot, None]
        gate, up = F.linear(x[token_rows], gate_up[local]).chunk(2, dim=-1)
        hidden = clamped_swiglu(gate.float(), up.float(), limit)
        if weight_before_down:
            y = F.linear((hidden * weight).to(x.dtype), down[local]).float()
        else:
            y = F.linear(hidden.to(x.dtype), down[local]).float() * weight
        out.index_add_(0, token_rows, y)
    return out


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    first: int, limit: float, weight_before_down: bool,
) -> torch.Tensor:
    """Same contract as `experts_reference`, without a host sync."""
    tokens, k = experts.shape
    held = gate_up.shape[0]
    local = experts.flatten() - first
    inside = (local >= 0) & (local < held)
    group = torch.where(inside, local, held)  # pairs of other ranks' experts sort last, past every group
    order = torch.argsort(group, stable=True)
    ends = torch.searchsorted(group[order], torch.arange(1, held + 1, device=x.device, dtype=group.dtype))
    offsets = ends.to(torch.int32)
    token_of = order // k
    gate, up = torch._grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    hidden = clamped_swiglu(gate.float(), up.float(), limit)
    weight = torch.where(inside[order], weights.flatten()[order], 0.0)[:, None]
    if weight_before_down:
        y = torch._grouped_mm((hidden * weight).to(x.dtype), down.transpose(1, 2), offs=offsets).float()
    else:
        y = torch._grouped_mm(hidden.to(x.dtype), down.transpose(1, 2), offs=offsets).float() * weight
    y = torch.where(inside[order][:, None], y, 0.0)  # rows past the last group are left unwritten
    per_slot = torch.empty_like(y)
    per_slot[order] = y
    return per_slot.view(tokens, k, -1).sum(dim=1)
