"""The row interface the Engram layers read through, its per-step handle, and the whole-table-in-memory
implementation.

A step's reads live in the `EngramStep` that `start` returns, not in the source: the rows of a layer
are the rows of *that* step, and the tokens whose rows failed are that step's, whatever order the
calls of several steps come in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from contract import EngramStats
from kernels import gather_engram_rows


@dataclass
class EngramStep:
    """One step's Engram reads: the ids each layer asked for, what each tier started for them, and
    the tokens (flat batch rows) whose rows could not be served, with the first reason."""

    row_ids: dict[int, torch.Tensor]  # layer index -> [T, columns] ids the source reads
    reads: dict[int, Any] = field(default_factory=dict)  # layer index -> the tier's in-flight state
    failed: dict[int, str] = field(default_factory=dict)

    def fail(self, token: int, why: str) -> None:
        self.failed.setdefault(token, why)


class RowSource(Protocol):
    def start(self, row_ids: Mapping[int, torch.Tensor]) -> EngramStep:
        """Begins a step's reads (layer index -> [T, columns] row ids), as soon as the ids are known,
        so that they overlap the layers before the first Engram layer."""
        ...

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        """Dequantized float32 rows [*ids.shape, head_dim] of the step's ids of Engram layer
        `layer_index`. Row ids include the per-column offsets. Rows that cannot be served come back as
        zeros and their tokens are in `step.failed`. Does not mutate the model."""
        ...

    def hint(self, request_ids: Sequence[str], row_ids: Mapping[int, torch.Tensor]) -> None:
        """Rows the requests will need next (layer index -> ids): worth reading now if `reads_ahead`."""
        ...

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its hints not read yet are dropped."""
        ...

    @property
    def reads_ahead(self) -> bool:
        """Whether some layer's rows come from slow storage, so that hints pay off."""
        ...

    def counters(self) -> EngramStats | None:
        """Rows served per tier, reads and waits since start; None for a source that keeps none."""
        ...

    def resident_bytes(self) -> int:
        """Memory the tables and row caches hold (the memory plan counts it with the weights)."""
        ...

    def check_integrity(self) -> None:
        """Asserts that the source's tables and caches are consistent (tests)."""
        ...

    def close(self) -> None:
        """Stops what the source started (I/O threads, readers); it serves no step after."""
        ...


class InMemoryEngramTable:
    """Every layer's table (fp8 values with power-of-two block scales, or float rows) resident in memory
    (host RAM or the compute device), without counters: what a load without engram options gets."""

    reads_ahead = False

    def __init__(self, values: list[torch.Tensor], scales: list[torch.Tensor]) -> None:
        self.values, self.scales = values, scales
        self.check_integrity()

    def start(self, row_ids: Mapping[int, torch.Tensor]) -> EngramStep:
        """Nothing to fetch: every row is resident."""
        return EngramStep(dict(row_ids))

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        values = self.values[layer_index]
        return gather_engram_rows(values, self.scales[layer_index], step.row_ids[layer_index].to(values.device))

    def hint(self, request_ids: Sequence[str], row_ids: Mapping[int, torch.Tensor]) -> None:
        """Nothing to read ahead."""

    def cancel(self, request_id: str) -> None:
        """No hints to drop."""

    def counters(self) -> None:
        return None

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values + self.scales)

    def close(self) -> None:
        """Memory only: nothing to stop."""

    def check_integrity(self) -> None:
        assert len(self.values) == len(self.scales), "a table without scales, or scales without a table"
        for v, s in zip(self.values, self.scales):
            assert v.shape[0] == s.shape[0] and v.shape[1] % s.shape[1] == 0, (tuple(v.shape), tuple(s.shape))
