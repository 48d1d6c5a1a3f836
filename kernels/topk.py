"""Top-k with a deterministic tie rule: among equal scores the lowest index wins.

torch.topk leaves the order of ties to the backend, so the same scores can select different
entries on CPU and GPU or at different batch sizes. A stable descending sort keeps equal scores in
index order, which makes every selection (MoE routing, indexer top-k) reproducible.
"""

import torch


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (values, indices) of the k largest entries along the last dim, ties by lowest index."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
