"""Engram fusion (DeepSeek-V4.1): gathered n-gram rows gated into every mHC stream.

The rows of all columns are concatenated and one projection `wkv` gives a key per stream plus one
shared value. Per stream: dot = sum(h * q_w * k_w * key) / (rms(h) * rms(key) * sqrt(D)),
gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) (a zero dot gives +1e-3), and out = h + gate * value. Dead positions
(padding, image spans) keep h unchanged. Everything runs in float32.
"""

from __future__ import annotations

import torch
from torch import nn

GATE_FLOOR = 1e-6


class EngramFusion(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, n_columns: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.hc, self.eps = hidden_size, hc_mult, eps
        self.wkv = nn.Linear(n_columns * head_dim, (hc_mult + 1) * hidden_size, bias=False, dtype=torch.float32)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))

    def gate_terms(self, streams: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D], rows [T, cols, head_dim] -> (kv [T, (hc+1)D], dot [T, hc], value [T, D])."""
        h = streams.float()
        kv = self.wkv(rows.flatten(1).float())
        key = kv[:, : self.hc * self.hidden].view(-1, self.hc, self.hidden)
        value = kv[:, self.hc * self.hidden :]
        dot = (h * self.q_weight * self.k_weight * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        return kv, dot * self.hidden**-0.5, value

    @staticmethod
    def gate(dot: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
        return gate if live is None else gate * live[:, None].to(gate.dtype)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        _, dot, value = self.gate_terms(streams, rows)
        gate = self.gate(dot, live)
        return (streams.float() + gate[..., None] * value[:, None, :]).to(streams.dtype)
