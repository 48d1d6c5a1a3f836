"""DeepSeek-V4.1 text model for serving: V4's shape with CSA2 attention, Engram layers and
"single-pass" mHC.

Single-pass mHC: each site's `pre` mix is computed from the streams it sees but collapses the streams
at the NEXT site; the first attention collapses with stream 0 alone, and the last `pre` feeds the final
norm (there is no hc_head). Engram layers inject their n-gram memory into the streams at the very
start of the layer, before that layer's mixes are computed. Names follow HF's DeepseekV41 modules, so
the reference's `save_pretrained` output loads by name.
"""

from __future__ import annotations

import torch
from torch import nn

from engram_store import EngramStep
from models.attention_v41 import SelectionTrace, SharedCompressedAttention
from models.batch import DecodeBatch, ForwardBatch
from models.cache import ModelCache
from models.config import ModelConfig
from models.csa2 import ChunkSelection
from models.engram import EngramMemory, engram_fusion
from models.hyper import HyperConnection, collapse, merge_streams
from models.layers import RMSNorm, logits_into, rope_step
from models.moe import MoE
from models.parallel import SINGLE, TensorParallel
from models.vocab import embedding, lm_head


class DecoderLayerV41(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = SharedCompressedAttention(config, layer, tp)
        self.mlp = MoE(config, layer, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        spec = config.engram
        self.engram = None
        if spec is not None and layer in spec.layer_ids:
            self.engram = engram_fusion(
                config.hidden_size, config.hc_mult, spec.n_columns, spec.head_dim, config.rms_norm_eps, tp
            )

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        batch: ForwardBatch,
        cache: ModelCache,
        selections: list[ChunkSelection],
        trace: SelectionTrace | None,
        engram_rows: torch.Tensor | None,
        tap: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [T, hc, D], incoming pre [T, hc]) -> (streams, this layer's ffn pre). `tap` [T, D]:
        receives the mean of the streams this layer's attention site reads (after its Engram)."""
        if self.engram is not None:
            streams = self.engram(streams, engram_rows)
        if tap is not None:
            tap.copy_(streams.mean(dim=1))
        attn_pre, post, comb, x = self.attn_hc.site(streams, self.input_layernorm, collapse_pre=pre)
        out = self.self_attn(x, batch, cache, selections, trace)
        streams = merge_streams(streams, post, comb, out)
        ffn_pre, post, comb, x = self.ffn_hc.site(streams, self.post_attention_layernorm, collapse_pre=attn_pre)
        out = self.mlp(x, batch.token_ids)
        return merge_streams(streams, post, comb, out), ffn_pre


class BackboneV41(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = embedding(config, tp)
        self.layers = nn.ModuleList(DecoderLayerV41(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV41(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's part of a tensor-parallel group (see DeepseekV4)."""
        super().__init__()
        self.config = config
        self.model = BackboneV41(config, tp)
        self.lm_head = lm_head(config, tp)
        self.engram_memory: EngramMemory | None = None  # attached by the loader (needs the tokenizer)
        self.mtp: nn.ModuleList | None = None  # the MTP draft layers, when loaded (models/mtp.py attach_mtp)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: ModelCache, trace: SelectionTrace | None = None, out: torch.Tensor | None = None,
        taps_out: dict[int, torch.Tensor] | None = None, streams_out: torch.Tensor | None = None,
        pre_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the chunks, appends them to their slots' state, returns logits [len(logits_rows), vocab]
        (written into `out` when the caller owns the buffer). `trace`, when given, records the indexers'
        selections and the Engram row ids (tests, debugging). `taps_out`: layer -> [T, hidden] buffer
        receiving every row's mean stream entering that layer's attention (DSpark's taps, models/dspark.py).
        `streams_out` [T, hc_mult, hidden] / `pre_out` [T, hc_mult] float32: receive every row's streams
        before the head and their last pre mixes (what a V4.1 MTP layer reads, models/mtp_v41.py)."""
        batch = batch.with_pages(cache.default_pages).to(self.lm_head.weight.device)
        streams, pre = self.residual_streams(batch, cache, trace, taps_out)
        _hand_out(streams, pre, streams_out, pre_out)
        last = batch.logits_rows
        return logits_into(self.head(streams[last], pre[last]), out)

    def residual_streams(
        self, batch: ForwardBatch, cache: ModelCache, trace: SelectionTrace | None = None,
        taps_out: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s layers over a batch whose chunks have their pages, on the model's device: appends
        the chunks to their slots' state and returns every row's (streams [T, hc, D], last pre [T, hc])
        before the head collapses them. Outside inference mode, so a training step differentiates
        through the serving math itself (tools/train_tiny.py)."""
        for chunk in batch.chunks:
            assert 0 <= chunk.slot < cache.num_slots, f"slot {chunk.slot} outside the cache"
            assert chunk.end_position <= cache.capacity(chunk.pages), f"slot {chunk.slot} would pass its pages"
        engram_step = self._engram_step(batch, cache, trace)
        embedded = self.model.embed_tokens(batch.token_ids)
        hc = self.config.hc_mult
        streams = embedded.unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = torch.zeros(streams.shape[0], hc, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        selections = [ChunkSelection() for _ in batch.chunks]
        engram_index = {layer: i for i, layer in enumerate(self.config.engram.layer_ids)} if self.config.engram else {}
        with rope_step():  # the layers of one rope kind share its cos / sin
            for index, layer in enumerate(self.model.layers):
                rows = None
                if index in engram_index:
                    rows = self.engram_memory.rows(engram_step, engram_index[index])
                tap = taps_out.get(index) if taps_out else None
                streams, pre = layer(streams, pre, batch, cache, selections, trace, rows, tap)
        return streams, pre

    def head(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Logits (in the head's dtype) of rows' streams [N, hc, D] collapsed by their last pre [N, hc]."""
        return self.lm_head(self.model.norm(collapse(pre, streams)))

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: ModelCache, engram_rows: list[torch.Tensor] | None = None,
               streams_out: torch.Tensor | None = None, pre_out: torch.Tensor | None = None,
               taps_out: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """A step of one new token per sequence (see DecodeBatch): float32 logits [B, vocab], reading no
        value on the host (worker/cuda_graphs.py captures it). `engram_rows`: per Engram layer, the
        rows [B, columns, head_dim] of the step's tokens (`engram_rows`), fetched before the step.
        `streams_out` / `pre_out` / `taps_out` as `forward`'s."""
        hc = self.config.hc_mult
        streams = self.model.embed_tokens(batch.token_ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = torch.zeros(streams.shape[0], hc, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        selection = ChunkSelection()  # the index sources' picks, for the whole batch
        engram_index = {layer: i for i, layer in enumerate(self.config.engram.layer_ids)} if self.config.engram else {}
        with rope_step():  # the layers of one rope kind share its cos / sin
            for index, layer in enumerate(self.model.layers):
                rows = engram_rows[engram_index[index]] if index in engram_index else None
                tap = taps_out.get(index) if taps_out else None
                streams, pre = layer(streams, pre, batch, cache, [selection], None, rows, tap)
        _hand_out(streams, pre, streams_out, pre_out)
        return self.lm_head(self.model.norm(collapse(pre, streams))).float()

    def engram_rows(self, slots: list[int] | torch.Tensor, token_ids: list[int] | torch.Tensor,
                    positions: list[int] | torch.Tensor, cache: ModelCache, waves: int = 1) -> list[torch.Tensor]:
        """The Engram rows of one decode step (one token per slot; a verify step's `waves` rows a slot,
        wave-major, hashed wave by wave: a row's n-grams end in its slot's earlier rows), per Engram
        layer, on the model's device; advances each slot's look-back in the cache (call once per step)."""
        if self.config.engram is None:
            return []
        if self.engram_memory is None:
            raise RuntimeError("this V4.1 checkpoint has Engram layers but no Engram memory was attached")
        memory, context = self.engram_memory, cache.engram_context
        n = len(slots) // waves
        ids = [memory.step_row_ids(slots[j * n: (j + 1) * n], token_ids[j * n: (j + 1) * n],
                                   positions[j * n: (j + 1) * n], context) for j in range(waves)]
        step = memory.start(ids[0] if waves == 1 else torch.cat(ids))
        return [memory.rows(step, i) for i in range(len(self.config.engram.layer_ids))]

    def _engram_step(self, batch: ForwardBatch, cache: ModelCache, trace: SelectionTrace | None) -> EngramStep | None:
        """The step's Engram reads, started before the first layer runs (None without Engram layers)."""
        if self.config.engram is None:
            return None
        if self.engram_memory is None:
            raise RuntimeError("this V4.1 checkpoint has Engram layers but no Engram memory was attached")
        ids = self.engram_memory.row_ids(batch, cache.engram_context)
        if trace is not None:
            trace.engram_row_ids.append(ids)
        return self.engram_memory.start(ids)


def _hand_out(streams: torch.Tensor, pre: torch.Tensor, streams_out: torch.Tensor | None,
              pre_out: torch.Tensor | None) -> None:
    if streams_out is not None:
        streams_out.copy_(streams)
    if pre_out is not None:
        pre_out.copy_(pre)
