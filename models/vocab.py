"""The token embedding and the LM head, vocabulary-parallel under tensor parallelism.

Both split the vocabulary rows evenly across ranks. The head's logits are all-gathered, so every rank
holds the same full-vocabulary logits and samples the same tokens. The embedding is vocabulary-
parallel too rather than replicated: it is the largest replicated tensor otherwise (V4.1-Flash:
129,280 x 5,120 = 1.3 GB in bf16 on every GPU), and its price is one all-reduce of [T, hidden] per
step, which is exact: each token's row comes from one rank, the others add zeros. At world size 1
both are the plain torch modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.parallel import TensorParallel, mark_shards


class VocabParallelEmbedding(nn.Embedding):
    """Rows [first, first + held) of the embedding; other ranks fill in the rest."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        shard = tp.shard("vocab_size", config.vocab_size)
        super().__init__(shard.size, config.hidden_size)
        self.tp, self.first = tp, shard.start
        mark_shards(self, weight=shard)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        embedded = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(embedded.masked_fill(elsewhere[:, None], 0.0))


class VocabParallelHead(nn.Linear):
    """Logits of vocabulary rows [first, first + held), all-gathered into the full vocabulary."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        shard = tp.shard("vocab_size", config.vocab_size)
        super().__init__(config.hidden_size, shard.size, bias=False)
        self.tp = tp
        mark_shards(self, weight=shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(super().forward(hidden), dim=-1)


def embedding(config: ModelConfig, tp: TensorParallel) -> nn.Embedding:
    if tp.world_size == 1:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(config, tp)


def lm_head(config: ModelConfig, tp: TensorParallel) -> nn.Linear:
    if tp.world_size == 1:
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return VocabParallelHead(config, tp)
