"""Small building blocks shared by the DeepSeek-V4 layers: RMS norms and interleaved RoPE."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import rms_norm
from models.config import RopeSpec


class RMSNorm(nn.Module):
    """RMS norm whose weight stays float32 (as released); the product is cast back once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, None, eps)


class RotaryTable:
    """cos / sin for one rope kind, computed for the positions of a step (one row per position)."""

    def __init__(self, spec: RopeSpec) -> None:
        self.inv_freq = spec.inv_freq()
        self.scale = spec.attention_factor
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The frequencies copied to the device once: a host-to-device copy per call would sync each
        step and cannot be captured in a CUDA graph."""
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the trailing `2 * cos.shape[-1]` channels of x, in float32.

    x is [N, D] or [N, heads, D]; cos / sin are [N, rope_dim / 2]. Pass -sin for the inverse rotation.
    """
    rope_dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def logits_into(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """float32 logits, copied into the caller's buffer when one is given."""
    if out is None:
        return logits.float()
    return out.copy_(logits)
