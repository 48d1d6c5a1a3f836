"""An MTP (multi-token prediction) layer for DeepSeek-V4.1: the draft model of the "mtp" proposer on V4.1.

The V4.1 release drafts with DSpark (models/dspark.py) and its reference describes no MTP layer; this one
is V4's MTP block (models/mtp.py) built from V4.1's modules, which the project's own default model
trains beside its target (tools/train_tiny.py) and which a V4.1 checkpoint ships as `mtp.N.*` with
`num_nextn_predict_layers` in its config. A row at position p holds the target's residual streams after
its last layer and their last `pre` mix (single-pass mHC: the weights that collapse them, [hc]), and
token p + 1; it predicts token p + 2:

    x = h_proj(hnorm(streams)) + e_proj(enorm(embed(token p + 1)))    (the second added to every stream)
    x, pre = a V4.1 decoder layer (window attention only, routed MoE, single-pass mHC) over x, its first
             site collapsing with the target's last pre
    logits = head(norm(collapse(pre, x)))                              (V4.1 has no hc_head)

The embedding and the head are the target's. Its output (x, pre) stands in for the target's at the next
step, so K drafts are K chained steps, as V4's (`MTPLayer` there: the same methods, `pre` given).
"""

from __future__ import annotations

import torch
from torch import nn

from models.batch import DecodeBatch, ForwardBatch
from models.cache import ModelCache
from models.config import ModelConfig
from models.csa2 import ChunkSelection
from models.hyper import collapse
from models.layers import RMSNorm, logits_into
from models.model_v41 import DecoderLayerV41
from models.mtp_inputs import MTPInputs
from models.parallel import SINGLE, TensorParallel


class MTPLayerV41(MTPInputs):
    """MTP layer `index` of a V4.1 `config`; `embed` and `head` are the target's (kept, not registered).
    Its state is a ModelCache of its own (models/mtp.py `allocate_mtp_cache`), in which it is layer
    `index`."""

    def __init__(self, config: ModelConfig, index: int, embed: nn.Module, head: nn.Module,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, index, embed, head)
        self.block = DecoderLayerV41(config.mtp_layers_config(), index, tp)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, cache: ModelCache, pre: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunks of rows (as V4's `MTPLayer.forward`; `pre` [T, hc] float32 the target's last mixes at
        them): (float32 logits of the logits rows, written into `out` when given; output streams [T, hc,
        D]; their last pre [T, hc]). Differentiable outside inference mode (tools/train_tiny.py trains it)."""
        batch = batch.with_pages(cache.default_pages).to(streams.device)
        x, last_pre = self._block(streams, pre, batch, cache, [ChunkSelection() for _ in batch.chunks])
        rows = batch.logits_rows
        return logits_into(self.head_logits(x[rows], last_pre[rows]), out), x, last_pre

    @torch.inference_mode()
    def advance(self, streams: torch.Tensor, batch: DecodeBatch, cache: ModelCache, pre: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode batch's rows (a verify batch's `waves` rows a sequence too) appended to the layer's
        state, without the head: (output streams, their last pre). Reads no value on the host."""
        return self._block(streams, pre, batch, cache, [ChunkSelection()])

    @torch.inference_mode()
    def draft_logits(self, streams: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [rows, vocab] of `advance`'s output rows."""
        return self.head_logits(streams, pre).float()

    def head_logits(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The target's head over rows collapsed by their pre, in the head's dtype."""
        _, head = self.shared
        return head(self.norm(collapse(pre, streams)))

    def _block(self, streams: torch.Tensor, pre: torch.Tensor | None, batch: ForwardBatch | DecodeBatch,
               cache: ModelCache, selections: list[ChunkSelection]) -> tuple[torch.Tensor, torch.Tensor]:
        if pre is None:
            raise ValueError("a V4.1 MTP layer reads the target's last pre mixes with its streams")
        return self.block(self._inputs(streams, batch.token_ids), pre, batch, cache, selections, None, None)
