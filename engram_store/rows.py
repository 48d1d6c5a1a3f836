"""The row interface the Engram layers read through, and the whole-table-in-memory implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import gather_engram_rows


class RowSource(Protocol):
    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows [*row_ids.shape, head_dim] of Engram layer `layer_index`'s table.
        Row ids include the per-column offsets. Does not mutate the model."""
        ...


class InMemoryEngramTable:
    """Every layer's table (fp8 values with power-of-two block scales, or float rows) resident in memory
    (host RAM or the compute device)."""

    def __init__(self, values: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
        assert len(values) == len(scales)
        for v, s in zip(values, scales):
            assert v.shape[0] == s.shape[0] and v.shape[1] % s.shape[1] == 0, (tuple(v.shape), tuple(s.shape))
        self.values, self.scales = values, scales

    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        return gather_engram_rows(self.values[layer_index], self.scales[layer_index], row_ids.to(self.values[layer_index].device))
