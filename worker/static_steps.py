"""What the proposers' fixed-shape draft steps share (worker/mtp_graphs.py, worker/dspark_graphs.py): a
step of decode chunks is at most 1 + K standing rows a sequence, laid out wave-major in batch buckets;
its inputs are one flat int64 buffer uploaded from a pinned staging copy in one transfer, its rows'
target tensors gathered into static rows by one indexed copy; one CUDA graph per bucket, or the same body
run eagerly when uncaptured (CPU, tests). And the proposers' split of a step between those steps and
their eager path."""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable

import torch

from worker.cuda_graphs import batch_buckets, capture_graphs


class StaticDraftSteps(ABC):
    def __init__(self, max_batch: int, k: int, input_length: int, device: torch.device) -> None:
        """`input_length`: the int64 inputs a subclass lays out in `inputs` / `host` (its own offsets)."""
        self.k = k
        self.sizes = batch_buckets(max_batch)
        self.waves = 1 + k  # rows a sequence: its own token and its K drafts
        self.max_rows = max_batch * self.waves
        self.inputs = torch.zeros(input_length, dtype=torch.long, device=device)
        self.staging = torch.zeros(input_length, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host = self.staging.numpy()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.runs: list[int] = []  # each step's sequences (the last 64)

    @abstractmethod
    def body(self, size: int) -> torch.Tensor:
        """What bucket `size`'s graph runs, from the static inputs."""

    @abstractmethod
    def fill_scratch(self, size: int) -> None:
        """Bucket `size`'s inputs all scratch rows (no sequence's state touched)."""


    def capture(self) -> None:
        """Captures one graph per batch bucket (largest first); `run` replays them from then on."""
        self.fill_scratch(self.sizes[-1])
        self.inputs.copy_(self.staging)
        self.graphs, self.outputs, _ = capture_graphs(sorted(self.sizes, reverse=True), self.body)

    def start(self, sequences: int) -> int:
        """The bucket of a step of `sequences`, its inputs reset to scratch rows for the caller to fill."""
        size = self.sizes[bisect_left(self.sizes, sequences)]
        self.runs = self.runs[-63:] + [sequences]
        self.fill_scratch(size)
        return size

    def rows_at(self, size: int, sequence: int, count: int) -> list[int]:
        """The wave-major rows of a bucket's `sequence` with `count` standing rows."""
        if not 1 <= count <= self.waves:
            raise ValueError(f"a sequence of {count} rows: the draft steps take 1 to {self.waves}")
        return [j * size + sequence for j in range(count)]

    def run(self, size: int, gathers: list[tuple[torch.Tensor, torch.Tensor]], destinations_at: int,
            count: int) -> torch.Tensor:
        """Uploads the inputs, copies each (static rows, their new values) of `gathers` to the `count`
        destinations at `destinations_at` of the inputs, and runs bucket `size`: its output."""
        self.inputs.copy_(self.staging, non_blocking=True)  # read back by the caller before it writes again
        where = self.inputs[destinations_at: destinations_at + count]
        for static, values in gathers:
            static.index_copy_(0, where, values)
        if not self.graphs:
            return self.body(size)
        self.graphs[size].replay()
        return self.outputs[size]


Drafts = dict[str, tuple[int, ...]]


def captured_bytes(build: Callable[[], StaticDraftSteps]) -> int:
    """Builds a proposer's static steps and captures their graphs; the device memory that took (their
    buffers and graph pool), which the memory plan adds to the workspace."""
    reserved = torch.cuda.memory_reserved()
    build().capture()
    return torch.cuda.memory_reserved() - reserved


def split_step(computed: list, static: list, propose_static: Callable[[list], Drafts],
               propose_eager: Callable[[list], Drafts]) -> Drafts:
    """A step's drafts: the `static` chunks' through the static steps, the rest of `computed` eagerly."""
    drafts = propose_static(static) if static else {}
    if len(static) < len(computed):
        taken = {id(item) for item in static}
        drafts |= propose_eager([item for item in computed if id(item) not in taken])
    return drafts
