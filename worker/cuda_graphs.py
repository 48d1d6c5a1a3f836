"""CUDA graphs for decode steps: the model's decode path captured once per (batch size, block-table
width) bucket, replayed with new inputs copied into the same static buffers.

A decode step of a MoE model launches a few hundred small kernels; launched one by one from Python
they cost more than the weights take to read. A graph launches them all at once. What makes a step
capturable is the models' `decode` (V4 and V4.1): shapes fixed by the batch, no host reads.

- Batch buckets 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (as vLLM); a step of n sequences
  replays the smallest bucket >= n, its extra rows padding: they decode token 0 at position 0 into a
  scratch slot and a scratch page that no request owns.
- Width buckets: the decode path reads every entry a block table can hold, so the table width is
  bucketed too (4,096 tokens, then x4, up to max_model_len); a step uses the smallest width that
  holds its longest sequence.
- Inputs live in one static int64 buffer [max batch, 4 + max width] (token, position, slot, draw row,
  pages); each step fills a pinned host copy of the rows it uses and copies it in one transfer. Two
  pinned copies take turns, so that with overlapped scheduling a step's rows are never written while
  the transfer of the step before may still be queued. A row whose token is still on the device (a
  PENDING_TOKEN input) names its row of the last step's draws, and one gather before the replay puts
  those tokens into the token column. Graphs share
  one memory pool, captured largest first; their outputs (float32 logits) stay valid until the next
  replay of the same graph.
- V4.1's Engram rows depend only on the step's tokens (a verify step's hashed wave by wave, padding
  rows too), so they are fetched before the replay (host
  cache, disk reads the prefetch hints started a step earlier) into static per-layer buffers the
  graph reads. The fetch takes the static inputs' token, slot and position columns where they are
  (the device; the last step's draws included): a warm step is hashed, looked up in the row caches'
  device indexes and gathered there, the host reading one miss count per layer and cache (store.py's
  DiskTier). The time the step waits for them is counted (`engram_wait_s`, reported by
  `bench.engram --cuda-graphs`). One graph per step, not split at the Engram layers: the rows are known before
  the first layer runs, so a split would only move the wait.
- Verify steps (speculative decoding, `waves` > 1): each sequence's last token and its drafts as a
  wave-major DecodeBatch of 1 + K rows a sequence (models/batch.py); graphs of every row count 2 ..
  `waves` are captured beside the one-row ones (batch x K buckets: the draft policy varies K, and a
  step of K drafts pays for 1 + K rows, not the most), a step replays the one of its most drafts and
  a sequence with fewer pads its missing waves with scratch rows. `keep_streams`: every graph also writes the rows' pre-head residual streams
  into a static buffer (what the MTP proposer reads; V4.1's last pre mixes too); `keep_taps`: the
  mean streams at a DSpark proposer's tap layers.
Uncaptured (a CPU test's), `run_waves` fills the same static inputs and runs the body eagerly.
After capture a replay asks the allocator for nothing (tests/test_gpu.py checks `num_device_alloc`
and reserved bytes across a served decode run).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch

from models import DecodeBatch, ModelCache

log = logging.getLogger("ds4serve.worker")

TOKEN, POSITION, SLOT, DRAW_ROW, PAGES = 0, 1, 2, 3, 4  # columns of the input buffer
FIRST_WIDTH_TOKENS = 4096
Key = TypeVar("Key", bound=Hashable)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, and max_batch itself, all <= max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def width_buckets(max_pages: int, block_tokens: int) -> list[int]:
    """Block-table widths in pages: 4,096 tokens' worth, then x4, and max_pages itself last."""
    widths, tokens = [], FIRST_WIDTH_TOKENS
    while tokens < max_pages * block_tokens:
        widths.append(-(-tokens // block_tokens))
        tokens *= 4
    return widths + [max_pages]


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step: its cache slot, the token it adds at `position`, its block table,
    and the row of the last step's draws that is its token instead (-1: `token_id` is known)."""

    slot: int
    token_id: int
    position: int
    pages: tuple[int, ...]
    draw_row: int = -1


def capture_graphs(keys: list[Key], body: Callable[[Key], torch.Tensor]
                   ) -> tuple[dict[Key, torch.cuda.CUDAGraph], dict[Key, torch.Tensor], int]:
    """Runs `body(key)` for every key eagerly on a side stream (its lazy allocations and kernel compiles
    happen outside any graph), then captures each in `keys`' order into one memory pool (largest first:
    the smaller ones reuse its blocks). Returns (graphs, their outputs, the bytes the capture reserved)."""
    reserved = torch.cuda.memory_reserved()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for key in keys:
            body(key)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for key in keys:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[key] = body(key)
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, outputs, torch.cuda.memory_reserved() - reserved


class DecodeGraphs:
    def __init__(self, model, cache: ModelCache, max_batch: int, max_pages: int, scratch_slot: int, scratch_page: int,
                 waves: int = 1, keep_streams: bool = False, keep_taps: tuple[int, ...] = ()):
        """`max_pages`: the widest block table (pages of max_model_len); `scratch_slot` /
        `scratch_page`: cache rows no request owns, written by padding rows. `waves` > 1: verify graphs
        of that many rows a sequence too (1 + the most drafts); `keep_streams`: the graphs write the
        rows' pre-head streams into `streams`; `keep_taps`: the mean stream at each of these layers
        (a DSpark proposer's taps) into `taps` [rows, len(keep_taps), hidden]."""
        self.model, self.cache = model, cache
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_pages, cache.block_tokens)
        self.waves = list(range(1, waves + 1))  # a verify graph for every draft count (the policy varies K)
        device = model.lm_head.weight.device
        rows = max_batch * self.waves[-1]
        self.inputs = torch.zeros(rows, PAGES + max_pages, dtype=torch.long, device=device)
        config = model.config
        self.streams = (torch.zeros(rows, config.hc_mult, config.hidden_size, dtype=model.lm_head.weight.dtype,
                                    device=device) if keep_streams else None)
        # V4.1's last pre mixes beside its streams (a V4.1 MTP layer reads both)
        self.pre = (torch.zeros(rows, config.hc_mult, device=device) if keep_streams and config.is_v41 else None)
        self.tap_layers = keep_taps
        self.taps = (torch.zeros(rows, len(keep_taps), config.hidden_size, dtype=model.lm_head.weight.dtype,
                                 device=device) if keep_taps else None)
        # pinned copies, taking turns; each written through numpy (the same memory, without torch's per-op cost)
        self.stagings = [torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=device.type == "cuda")
                         for _ in range(2)]
        self.staging = self.stagings[0]
        self.host = self.staging.numpy()
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}  # (size, width, waves)
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        self.pool_bytes = 0
        self.replays = 0
        self.engram_wait_s = 0.0  # time steps spent fetching Engram rows before their replay
        self.engram_rows = self._engram_buffers(model, rows, device)

    @staticmethod
    def _engram_buffers(model, rows: int, device) -> list[torch.Tensor]:
        """Static [rows, columns, head_dim] float32 rows per Engram layer (none for V4); graphs run on one
        rank, which holds every column."""
        spec = model.config.engram
        if spec is None:
            return []
        return [torch.zeros(rows, spec.n_columns, spec.head_dim, device=device) for _ in spec.layer_ids]

    def decode_eagerly(self, size: int, width: int, waves: int = 1) -> torch.Tensor:
        """What the (size, width, waves) graph runs, run eagerly on the static inputs (warm-up, capture, tests)."""
        batch, rows = self.static_batch(size, width, waves), size * waves
        kept = {}
        if self.streams is not None:
            kept["streams_out"] = self.streams[:rows]
        if self.pre is not None:
            kept["pre_out"] = self.pre[:rows]
        if self.taps is not None:
            kept["taps_out"] = {layer: self.taps[:rows, i] for i, layer in enumerate(self.tap_layers)}
        if self.engram_rows:
            return self.model.decode(batch, self.cache, [buffer[:rows] for buffer in self.engram_rows], **kept)
        return self.model.decode(batch, self.cache, **kept)

    def static_batch(self, size: int, width: int, waves: int = 1) -> DecodeBatch:
        """The bucket's batch: views of the static input buffer the graph reads."""
        rows = self.inputs[: size * waves]
        return DecodeBatch(rows[:, TOKEN], rows[:, POSITION], rows[:, SLOT], rows[:, PAGES : PAGES + width], waves)

    def _fill_padding(self, first: int, size: int) -> None:
        pad = self.host[first:size]
        pad[:, TOKEN] = 0
        pad[:, POSITION] = 0
        pad[:, SLOT] = self.scratch_slot
        pad[:, DRAW_ROW] = -1
        pad[:, PAGES:] = self.scratch_page

    def capture(self) -> None:
        """Warms every bucket up eagerly on a side stream, then captures them largest first."""
        self._fill_padding(0, self.inputs.shape[0])
        self.inputs.copy_(self.staging)
        keys = [(size, width, waves) for waves in self.waves for width in self.widths for size in self.sizes]
        largest_first = sorted(keys, key=lambda k: (k[0] * k[2], k[1]), reverse=True)
        self.graphs, self.outputs, self.pool_bytes = capture_graphs(largest_first,
                                                                    lambda key: self.decode_eagerly(*key))
        log.info("captured %d decode graphs (batch %s x table width %s pages x waves %s), %.1f MiB",
                 len(self.graphs), self.sizes, self.widths, self.waves, self.pool_bytes / 2**20)

    def fits(self, batch: int, widest_table: int) -> bool:
        """Whether one captured bucket holds `batch` rows whose longest block table has `widest_table` pages."""
        return 0 < batch <= self.sizes[-1] and widest_table <= self.widths[-1]

    def bucket(self, rows: list[DecodeRow]) -> tuple[int, int]:
        """(batch size, table width) of the graph that runs these rows."""
        size = self.sizes[bisect_left(self.sizes, len(rows))]
        return size, self.widths[bisect_left(self.widths, max(len(r.pages) for r in rows))]

    def run(self, rows: list[DecodeRow], last_draws: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [len(rows), vocab] of one decode step (a view of the graph's output);
        `last_draws`: the tokens of the last step's draws, which rows with a `draw_row` take."""
        return self.run_waves([rows], last_draws)[: len(rows)]

    def run_waves(self, waves: list[list[DecodeRow | None]], last_draws: torch.Tensor | None = None) -> torch.Tensor:
        """One step of len(waves) rows a sequence (a verify step; one wave: a decode step): waves[j][i]
        is sequence i's j-th row (None: a padding row). float32 logits [size x waves, vocab], wave-major
        with the bucket's `size` rows a wave (`bucket`), a view of the graph's output; `streams`
        holds the same rows' streams when kept."""
        first = waves[0]
        n, count = len(first), len(waves)
        size, width = self.bucket(first)
        self.staging = self.stagings[self.replays % 2]
        self.host = host = self.staging.numpy()
        for j, wave in enumerate(waves):
            for i, row in enumerate(wave):
                at = j * size + i
                if row is None:
                    self._fill_padding(at, at + 1)
                    continue
                host[at, TOKEN], host[at, POSITION], host[at, SLOT] = row.token_id, row.position, row.slot
                host[at, DRAW_ROW] = row.draw_row
                host[at, PAGES : PAGES + len(row.pages)] = row.pages
                host[at, PAGES + len(row.pages) : PAGES + width] = row.pages[-1]
            self._fill_padding(j * size + n, (j + 1) * size)
        total = size * count
        # one transfer; these pinned rows are not written again before the next step landed
        self.inputs[:total].copy_(self.staging[:total], non_blocking=True)
        if last_draws is not None and any(row.draw_row >= 0 for row in first):  # a decode step's inputs only
            draw_rows = self.inputs[:n, DRAW_ROW]
            taken = last_draws[draw_rows.clamp(0, last_draws.shape[0] - 1)]
            self.inputs[:n, TOKEN] = torch.where(draw_rows >= 0, taken, self.inputs[:n, TOKEN])
        if self.engram_rows:
            began = time.perf_counter()
            # a decode step's own rows; a verify step's every row, its waves hashed in order
            inputs = self.inputs[:n] if count == 1 else self.inputs[:total]
            fetched = self.model.engram_rows(inputs[:, SLOT], inputs[:, TOKEN], inputs[:, POSITION], self.cache,
                                             waves=count)
            for buffer, layer_rows in zip(self.engram_rows, fetched):
                buffer[: layer_rows.shape[0]].copy_(layer_rows)
            self.engram_wait_s += time.perf_counter() - began
        self.replays += 1
        if not self.graphs:  # not captured (CPU tests): the body the graph would run
            return self.decode_eagerly(size, width, count)
        self.graphs[size, width, count].replay()
        return self.outputs[size, width, count]
