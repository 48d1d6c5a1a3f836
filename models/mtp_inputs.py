"""What the MTP layers of V4 (models/mtp.py) and V4.1 (models/mtp_v41.py) share: a row's input is the
target's residual streams at position p and the embedding of token p + 1, each normed and projected,
the second added to every stream; the embedding and the head are the target's (kept, not registered:
they are not the layer's parameters, and the checkpoint names them once)."""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.layers import RMSNorm


class MTPInputs(nn.Module):
    def __init__(self, config: ModelConfig, index: int, embed: nn.Module, head: nn.Module) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.index = index
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.shared = (embed, head)

    def _inputs(self, streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """h_proj(hnorm(streams)) + e_proj(enorm(embed(token_ids))), the second on every stream."""
        embed, _ = self.shared
        tokens = self.e_proj(self.enorm(embed(token_ids)))
        return self.h_proj(self.hnorm(streams)) + tokens.unsqueeze(1)
