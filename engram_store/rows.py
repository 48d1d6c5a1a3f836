"""The row interface the Engram layers read through, and the whole-table-in-memory implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels import gather_engram_rows


class RowSource(Protocol):
    def prefetch(self, row_ids: torch.Tensor) -> None:
        """The step's row ids [T, engram layers, columns], as soon as they are known."""
        ...

    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows [*row_ids.shape, head_dim] of Engram layer `layer_index`'s table.
        Row ids include the per-column offsets. Does not mutate the model."""
        ...

    def failed_tokens(self) -> dict[int, str]:
        """Batch rows of the last step whose Engram rows could not be served (they got zeros), and why."""
        ...

    def resident_bytes(self) -> int:
        """Memory the tables and row caches hold (the memory plan counts it with the weights)."""
        ...


class InMemoryEngramTable:
    """Every layer's table (fp8 values with power-of-two block scales, or float rows) resident in memory
    (host RAM or the compute device)."""

    def __init__(self, values: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
        assert len(values) == len(scales)
        for v, s in zip(values, scales):
            assert v.shape[0] == s.shape[0] and v.shape[1] % s.shape[1] == 0, (tuple(v.shape), tuple(s.shape))
        self.values, self.scales = values, scales

    def prefetch(self, row_ids: torch.Tensor) -> None:
        """Nothing to fetch: every row is resident."""

    def failed_tokens(self) -> dict[int, str]:
        return {}

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values + self.scales)

    def rows(self, layer_index: int, row_ids: torch.Tensor) -> torch.Tensor:
        return gather_engram_rows(self.values[layer_index], self.scales[layer_index], row_ids.to(self.values[layer_index].device))
