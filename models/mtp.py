"""DeepSeek-V4's MTP (multi-token prediction) layer: the draft model of the "mtp" proposer.

The checkpoint's `mtp.N.*` layer (DeepSeek's V4 inference code, `MTPBlock` in inference/model.py; vLLM's
models/deepseek_v4_mtp.py reads it the same way). A row at position p holds the target's residual
streams after its last layer (before the head collapses them: [hc_mult, D]) for token p, and token p + 1;
it predicts token p + 2:

    x = h_proj(hnorm(streams)) + e_proj(enorm(embed(token p + 1)))     (the second added to every stream)
    x = one V4 decoder layer over x at position p (its own attention state, MoE and mHC)
    logits = head(norm(hc_head(x)))                                    (its own hc_head and norm)

The embedding and the head are the target's. The released V4 checkpoints list the MTP layer's compress
ratio after the layers' (0: a sliding-window layer, with the plain rope of sliding layers) and give it a
routed (not hash) MoE. Its output streams x stand in for the target's at the next step: K drafts are K
chained steps at positions p, p + 1, ... (`greedy_drafts`). With one MTP layer, every step reuses it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from models.batch import DecodeBatch, ForwardBatch
from models.cache import ModelCache
from models.config import ConfigError, ModelConfig
from models.hyper import HyperHead
from models.layers import RMSNorm, logits_into
from models.model import DecoderLayer, DeepseekV4
from models.model_v41 import DeepseekV41
from models.mtp_inputs import MTPInputs
from models.mtp_v41 import MTPLayerV41
from models.parallel import SINGLE, TensorParallel


class MTPLayer(MTPInputs):
    """MTP layer `index` of `config`; `embed` and `head` are the target's (kept, not registered: they are
    not this layer's parameters). Its attention state is a ModelCache of its own (`allocate_mtp_cache`),
    in which it is layer `index`."""

    def __init__(self, config: ModelConfig, index: int, embed: nn.Module, head: nn.Module,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, index, embed, head)
        self.block = DecoderLayer(config.mtp_layers_config(), index, tp)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, streams: torch.Tensor, batch: ForwardBatch, cache: ModelCache, pre: None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Chunks of rows: `streams` [T, hc_mult, D] are the target's pre-head streams at the rows'
        positions, `batch.token_ids` the token after each (the row of position p holds token p + 1), at
        `batch.positions` in `batch`'s slots of `cache`. Appends the rows to the layer's state; returns
        (float32 logits [len(logits_rows), vocab], written into `out` when given: the draft of the token
        after each logits row's; this layer's output streams [T, hc_mult, D], for the next step; None:
        V4 hands no mixes on, which V4.1's layer does, models/mtp_v41.py, whose methods these are)."""
        batch = batch.with_pages(cache.default_pages).to(streams.device)
        x = self.block(self._inputs(streams, batch.token_ids), batch, cache, self.index)
        return self._logits(x[batch.logits_rows], out), x, None

    @torch.inference_mode()
    def decode(self, streams: torch.Tensor, batch: DecodeBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per sequence (streams [B, hc_mult, D], as `forward`'s): (float32 logits [B, vocab],
        output streams [B, hc_mult, D]). Reads no value on the host, so a CUDA graph can capture it."""
        x, _ = self.advance(streams, batch, cache)
        return self._logits(x, None), x

    @torch.inference_mode()
    def advance(self, streams: torch.Tensor, batch: DecodeBatch, cache: ModelCache, pre: None = None
                ) -> tuple[torch.Tensor, None]:
        """`decode` without the head: the output streams of a decode batch's rows (a verify batch's
        `waves` rows a sequence too), appended to the layer's state. Only the rows that draft need
        logits (`draft_logits`): the head reads the whole vocabulary's weights."""
        return self.block(self._inputs(streams, batch.token_ids), batch, cache, self.index), None

    @torch.inference_mode()
    def draft_logits(self, streams: torch.Tensor, pre: None = None) -> torch.Tensor:
        """float32 logits [rows, vocab] of output streams [rows, hc_mult, D] (`advance`'s)."""
        return self._logits(streams, None)

    def _logits(self, streams: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        _, head = self.shared
        return logits_into(head(self.norm(self.hc_head(streams))), out)


def attach_mtp(model: DeepseekV4 | DeepseekV41, tp: TensorParallel = SINGLE) -> nn.ModuleList:
    """Builds the config's MTP layers (on the default device: meta while loading) as `model.mtp`, sharing
    the model's embedding and head, so their parameters are the model's `mtp.N.*`: V4's, or V4.1's
    (models/mtp_v41.py; the V4.1 release has none, its drafts are DSpark's, but a V4.1 checkpoint may
    ship them, as this project's default model does). ConfigError when the config has none."""
    config = model.config
    if not config.num_nextn_predict_layers:
        raise ConfigError("the model has no MTP layers (config.json: num_nextn_predict_layers 0 or absent)")
    layer = MTPLayerV41 if config.is_v41 else MTPLayer
    model.mtp = nn.ModuleList(layer(config, i, model.model.embed_tokens, model.lm_head, tp)
                              for i in range(config.num_nextn_predict_layers))
    return model.mtp


def allocate_mtp_cache(config: ModelConfig, num_slots: int, max_len: int, **options) -> ModelCache:
    """The MTP layers' own state for `num_slots` sequences (layer i's at `layers[i]`): ModelCache.allocate
    for the MTP layers alone, with its options (dtype, device, draft_tokens, ...). A sliding MTP layer
    keeps only a window ring per slot; give it `draft_tokens` K when it drafts K tokens, so that the rows
    chained drafts write never overwrite rows a position before them still reads."""
    return ModelCache.allocate(config.mtp_layers_config(), num_slots, max_len, **options)


def greedy_drafts(layer: "MTPLayer | MTPLayerV41", streams: torch.Tensor, batch: DecodeBatch, cache: ModelCache,
                  k: int, pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k greedy drafts per sequence, chained: the first step reads `streams` (and V4.1's `pre`) and
    `batch` (as `decode`: the target's at position p and token p + 1), each later one the step before's
    output and argmax token, one position on. Returns (drafts [B, k], float32 logits [B, k, vocab]);
    reads no value on the host."""
    drafts, logits = [], []
    for _ in range(k):
        streams, pre = layer.advance(streams, batch, cache, pre)
        step = layer.draft_logits(streams, pre)
        drafts.append(step.argmax(dim=-1))
        logits.append(step)
        batch = replace(batch, token_ids=drafts[-1], positions=batch.positions + 1)
    return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)
