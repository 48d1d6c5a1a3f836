"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel streams.

Before each sublayer a learned map of the (RMS-normed, flattened) streams gives three mixes:
`pre` collapses the streams into the sublayer input, `post` spreads the sublayer output back over
the streams, and `comb` (made doubly stochastic by Sinkhorn-Knopp) mixes the residual streams:
new[k] = post[k] * out + sum_j comb[j, k] * streams[j]. All of it runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.hyper import hc_collapse as collapse  # noqa: F401  (the models' import point)
from kernels.hyper import hc_merge as merge_streams  # noqa: F401
from kernels.hyper import InputNorm, hc_site
from models.config import ModelConfig
from models.layers import RMSNorm, unweighted_rms_norm


class HyperConnection(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n = config.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, input_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """V4: streams [T, n, D] -> (post [T, n], comb [T, n, n], the sublayer input [T, D]: the streams
        collapsed with this site's own `pre`, through the sublayer's `input_norm`)."""
        _, post, comb, collapsed = self.site(streams, input_norm)
        return post, comb, collapsed

    def site(self, streams: torch.Tensor, input_norm: RMSNorm, collapse_pre: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (pre [T, n], post [T, n], comb [T, n, n] in float32, the sublayer input
        [T, D]: the collapse through `input_norm`, in the site's last kernel on the GPU). V4.1 collapses
        with the previous site's `pre` (`collapse_pre`), V4 with this site's own."""
        return hc_site(streams, self.fn, self.base, self.scale, self.n, self.iters, self.hc_eps, self.norm_eps,
                       collapse_pre, InputNorm(input_norm.weight, input_norm.eps))



class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm (a `pre`-only mix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return collapse(pre, streams)
