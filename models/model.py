"""DeepSeek-V4 for serving: one forward over a flat batch of chunks from several sequences.

Module and parameter names are Hugging Face transformers' (`model.layers.N.self_attn.q_a_proj`,
`model.layers.N.mlp.experts.gate_up_proj`, ...), so a checkpoint's tensors load by name. The forward
reads per-step metadata from a ForwardBatch and keeps every per-sequence state in a caller-owned
ModelCache; only the rows named in `batch.logits_rows` reach the vocabulary head.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention import Attention
from models.batch import DecodeBatch, ForwardBatch
from models.cache import ModelCache
from models.config import ModelConfig
from models.engram import EngramMemory
from models.hyper import HyperConnection, HyperHead, merge_streams
from models.layers import RMSNorm, logits_into, rope_step
from models.moe import MoE
from models.parallel import SINGLE, TensorParallel
from models.vocab import embedding, lm_head


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        self.mlp = MoE(config, layer, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch | DecodeBatch, cache: ModelCache, layer: int) -> torch.Tensor:
        attend = self.self_attn.decode if isinstance(batch, DecodeBatch) else self.self_attn
        post, comb, x = self.attn_hc(streams, self.input_layernorm)
        out = attend(x, batch, cache.layers[layer])
        streams = merge_streams(streams, post, comb, out)
        post, comb, x = self.ffn_hc(streams, self.post_attention_layernorm)
        out = self.mlp(x, batch.token_ids)
        return merge_streams(streams, post, comb, out)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = embedding(config, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


class DeepseekV4(nn.Module):
    engram_memory: EngramMemory | None = None  # V4 has no Engram layers (DeepseekV41's loader attaches one)

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's part of a tensor-parallel group (sizes are this rank's shards); every
        rank's forward returns the same full-vocabulary logits."""
        super().__init__()
        self.config = config
        self.model = Backbone(config, tp)
        self.lm_head = lm_head(config, tp)
        self.mtp: nn.ModuleList | None = None  # the MTP draft layers, when loaded (models/mtp.py attach_mtp)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache, out: torch.Tensor | None = None,
                streams_out: torch.Tensor | None = None, taps_out: dict[int, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Runs the chunks, appends them to their slots' state, returns logits [len(logits_rows), vocab]
        (written into `out` when the caller owns the buffer). `streams_out` [T, hc_mult, hidden]: receives
        every row's residual streams after the last layer (what the MTP layers read, models/mtp.py).
        `taps_out`: layer -> [T, hidden] buffer receiving every row's mean stream leaving that layer
        (V4-Flash-0731's DSpark taps, models/dspark.py: V4 taps a layer's output, V4.1 its input)."""
        batch = batch.with_pages(cache.default_pages).to(self.lm_head.weight.device)
        self._check(batch, cache)
        streams = self._streams(batch.token_ids)
        with rope_step():  # the layers of one rope kind share its cos / sin
            for index, layer in enumerate(self.model.layers):
                streams = layer(streams, batch, cache, index)
                if taps_out and index in taps_out:
                    taps_out[index].copy_(streams.mean(dim=1))
        if streams_out is not None:
            streams_out.copy_(streams)
        hidden = self.model.norm(self.model.hc_head(streams[batch.logits_rows]))
        return logits_into(self.lm_head(hidden), out)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: ModelCache, streams_out: torch.Tensor | None = None,
               taps_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """A step of one new token per sequence (see DecodeBatch): float32 logits [B, vocab]. Reads no
        value on the host, so worker/cuda_graphs.py captures it; the same numbers as `forward` up to
        the order of float sums. `streams_out` and `taps_out` as `forward`'s ([B, ...])."""
        streams = self._streams(batch.token_ids)
        with rope_step():  # the layers of one rope kind share its cos / sin
            for index, layer in enumerate(self.model.layers):
                streams = layer(streams, batch, cache, index)
                if taps_out and index in taps_out:
                    taps_out[index].copy_(streams.mean(dim=1))
        if streams_out is not None:
            streams_out.copy_(streams)
        return self.lm_head(self.model.norm(self.model.hc_head(streams))).float()

    def _streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedded tokens copied into each of the hc_mult residual streams."""
        embedded = self.model.embed_tokens(token_ids)
        return embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def _check(self, batch: ForwardBatch, cache: ModelCache) -> None:
        for chunk in batch.chunks:
            assert 0 <= chunk.slot < cache.num_slots, f"slot {chunk.slot} outside the cache"
            assert chunk.end_position <= cache.capacity(chunk.pages), f"slot {chunk.slot} would pass its pages"
