"""The tiny model's MTP (multi-token prediction) head, in the form a V4.1 MTP layer takes here.

The project serves MTP drafts for V4 only (models/mtp.py; V4.1's drafts would be DSpark's), and the
V4.1 reference describes no MTP layer's internals, so this head is V4's MTPLayer built from V4.1's
modules: a row at position p holds the target's residual streams after its last layer and token p + 1,
and predicts token p + 2:

    x = h_proj(hnorm(streams)) + e_proj(enorm(embed(token p + 1)))    (the second added to every stream)
    x, pre = DecoderLayerV41 (sliding window only, routed MoE, single-pass mHC) over x, collapsing with
             the target's last pre first
    logits = head(norm(collapse(pre, x)))                              (V4.1 has no hc_head)

The embedding and the head are the target's. Saved as `mtp.0.*` (the loader drops `mtp.*` of a V4.1
checkpoint); config.json says num_nextn_predict_layers 1, which V4.1's config reading ignores.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from models.batch import ForwardBatch
from models.cache import ModelCache
from models.config import MOE, ModelConfig
from models.config_v41 import SLIDING, SharedCompression
from models.csa2 import ChunkSelection
from models.hyper import collapse
from models.layers import RMSNorm
from models.model_v41 import DecoderLayerV41, DeepseekV41
from models.parallel import SINGLE


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The MTP layer alone as a one-layer V4.1: window attention, no compression, no Engram."""
    return replace(
        config, num_layers=1, layer_types=(SLIDING,), compress_rates=(0,), mlp_layer_types=(MOE,), engram=None,
        shared_compression=SharedCompression((), (), None, 8, 1),
    )


class MTPHeadV41(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.config = mtp_layer_config(config)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.block = DecoderLayerV41(self.config, 0, SINGLE)
        self.norm = RMSNorm(d, eps)

    def allocate_cache(self, num_slots: int, max_len: int, device: torch.device | str) -> ModelCache:
        return ModelCache.allocate(self.config, num_slots, max_len, device=device)

    def forward(self, target: DeepseekV41, streams: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch,
                cache: ModelCache) -> torch.Tensor:
        """Logits [T, vocab] of `batch`'s rows (chunks with their pages, on the device): `streams` [T, hc, D]
        and `pre` [T, hc] are the target's at the rows' positions, `batch.token_ids` the token after each."""
        tokens = self.e_proj(self.enorm(target.model.embed_tokens(batch.token_ids)))
        x = self.h_proj(self.hnorm(streams)) + tokens.unsqueeze(1)
        selections = [ChunkSelection() for _ in batch.chunks]
        x, last_pre = self.block(x, pre, batch, cache, selections, None, None)
        return target.lm_head(self.norm(collapse(last_pre, x)))

