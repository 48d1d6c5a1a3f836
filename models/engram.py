"""Engram fusion (DeepSeek-V4.1): gathered n-gram rows gated into every mHC stream.

The rows of all columns are concatenated and one projection `wkv` gives a key per stream plus one
shared value. Per stream: dot = sum(h * q_w * k_w * key) / (rms(h) * rms(key) * sqrt(D)),
gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) (a zero dot gives +1e-3), and out = h + gate * value. Dead positions
(padding, image spans) keep h unchanged. Everything runs in float32.

Tensor parallel: the tables split by hash heads (the table's columns, one per n-gram order and
head) into equal runs, so each rank holds and reads only its heads' rows, a contiguous run of each
table. The fusion then needs every column's row for every token. Of the two ways to get there, the
bytes each rank receives per token and Engram layer (float32, ring collectives, w ranks, C columns
of d channels, hc streams of D; V4.1-Flash: C = 24, d = 256, D = 5120, hc = 4):
- all-gather the rows, and split wkv by output columns (each rank computes its D/w channels of every
  key and of the value), then all-gather [its value channels | its partial dot and key square sums]:
  (w-1)/w * C*d*4 + (w-1) * (D/w + 2*hc) * 4  = 12,288 + 10,272 = 22,560 B at w = 2 (33,888 at w = 4);
- split wkv by input rows (each rank projects its own columns) and all-reduce the partial
  [(hc+1) * D] projection: 2 * (w-1)/w * (hc+1)*D*4 = 102,400 B at w = 2 (153,600 at w = 4).
The first moves about 4.5x fewer bytes, so it is what ShardedEngramFusion does: with V4.1-Flash's two
Engram layers a step of T tokens moves 2 * 22,560 * T bytes per rank for Engram at w = 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from contract import EngramStats
from engram_store.hashing import NgramHasher
from engram_store.rows import EngramStep, RowSource
from models.batch import ForwardBatch
from models.parallel import TensorParallel, mark_shards

GATE_FLOOR = 1e-6


class EngramFusion(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, n_columns: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.hc, self.eps = hidden_size, hc_mult, eps
        self.wkv = nn.Linear(n_columns * head_dim, (hc_mult + 1) * hidden_size, bias=False, dtype=torch.float32)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32))

    def gate_terms(self, streams: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D], rows [T, cols, head_dim] -> (kv [T, (hc+1)D], dot [T, hc], value [T, D])."""
        h = streams.float()
        kv = self.wkv(rows.flatten(1).float())
        key = kv[:, : self.hc * self.hidden].view(-1, self.hc, self.hidden)
        value = kv[:, self.hc * self.hidden :]
        dot = (h * self.q_weight * self.k_weight * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        return kv, dot * self.hidden**-0.5, value

    @staticmethod
    def gate(dot: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
        return gate if live is None else gate * live[:, None].to(gate.dtype)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        _, dot, value = self.gate_terms(streams, rows)
        gate = self.gate(dot, live)
        return (streams.float() + gate[..., None] * value[:, None, :]).to(streams.dtype)


class ShardedEngramFusion(nn.Module):
    """EngramFusion on one rank of w: gets its heads' rows, holds channels [first, first + D/w) of
    every key and of the value (wkv, q_weight, k_weight cut along the hidden dim), and returns the
    same streams on every rank (module docstring: why this split)."""

    def __init__(self, hidden_size: int, hc_mult: int, n_columns: int, head_dim: int, eps: float,
                 tp: TensorParallel) -> None:
        super().__init__()
        channels = tp.shard("hidden_size", hidden_size)
        self.hidden, self.hc, self.eps, self.tp = hidden_size, hc_mult, eps, tp
        self.first, self.width = channels.start, channels.size
        self.wkv = nn.Linear(n_columns * head_dim, (hc_mult + 1) * self.width, bias=False, dtype=torch.float32)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, self.width, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, self.width, dtype=torch.float32))
        mark_shards(self.wkv, weight=tp.shard("hidden_size", hidden_size, blocks=hc_mult + 1))
        mark_shards(self, q_weight=tp.shard("hidden_size", hidden_size, dim=1),
                    k_weight=tp.shard("hidden_size", hidden_size, dim=1))

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """streams [T, hc, D], rows [T, this rank's columns, head_dim] -> streams [T, hc, D]."""
        h, hc, width = streams.float(), self.hc, self.width
        kv = self.wkv(self.tp.all_gather(rows.float(), dim=1).flatten(1))  # every column, in column order
        key = kv[:, : hc * width].view(-1, hc, width)
        own = h[..., self.first : self.first + width]
        partial = [(own * self.q_weight * self.k_weight * key).sum(-1), key.square().sum(-1), kv[:, hc * width :]]
        gathered = self.tp.all_gather(torch.cat(partial, dim=-1)[None], dim=0)  # [w, T, 2hc + D/w]
        sums = gathered[..., : 2 * hc].sum(0)  # summed in rank order: the same bits on every rank
        value = gathered[..., 2 * hc :].transpose(0, 1).flatten(1)
        dot = sums[:, :hc] * torch.rsqrt(h.square().mean(-1) + self.eps)
        dot = dot * torch.rsqrt(sums[:, hc:] / self.hidden + self.eps) * self.hidden**-0.5
        gate = EngramFusion.gate(dot, live)
        return (h + gate[..., None] * value[:, None, :]).to(streams.dtype)


def engram_fusion(
    hidden_size: int, hc_mult: int, n_columns: int, head_dim: int, eps: float, tp: TensorParallel
) -> EngramFusion | ShardedEngramFusion:
    if tp.world_size == 1:
        return EngramFusion(hidden_size, hc_mult, n_columns, head_dim, eps)
    return ShardedEngramFusion(hidden_size, hc_mult, n_columns, head_dim, eps, tp)


@dataclass(frozen=True)
class EngramShard:
    """The hash heads (table columns) [first, end) one rank holds, and per Engram layer the shift
    from a row's id in the whole table to its id in the rank's source: minus the first row of its
    heads where the source holds only those rows in memory, 0 where it reads the shared table file."""

    first: int
    end: int
    shifts: tuple[int, ...]

    def source_ids(self, row_ids: torch.Tensor) -> torch.Tensor:
        """[N, layers, columns] whole-table row ids -> [N, layers, own columns] ids the source reads."""
        shifts = torch.tensor(self.shifts, dtype=row_ids.dtype, device=row_ids.device)
        return row_ids[:, :, self.first : self.end] + shifts[:, None]


@dataclass(frozen=True)
class HashedToken:
    """A hinted next token's row ids [layers, columns], with the look-back it was hashed in and the
    look-back after it: the step that feeds the token reuses them if its slot still holds that look-back
    (row ids depend only on the token and the look-back), so the token is hashed once."""

    token_id: int
    context: tuple[int, ...]
    advanced: tuple[int, ...]
    row_ids: np.ndarray

    def fits(self, token_ids: list[int], context: list[int]) -> bool:
        """Whether a chunk of these tokens after this look-back is the hinted token at its next position."""
        return token_ids == [self.token_id] and tuple(context) == self.context


class EngramMemory:
    """Everything an Engram forward needs besides the fusion weights: the n-gram hasher (from the
    checkpoint's tokenizer) and the row source (in memory here; engram_store/ streams from disk).

    Row ids depend only on tokens, so one call hashes the whole step for every Engram layer; each slot's
    look-back (the last max_ngram - 1 compressed ids) is carried in the cache between steps. Under
    tensor parallelism (`shard`) every rank hashes every column (cheap, and the look-back stays
    whole) but asks its source only for its own heads' rows.

    The model hashes (`row_ids` / `step_row_ids`), starts the step's reads (`start`, an EngramStep)
    and reads each layer's rows through that step (`rows`). The runner asks for the last step's
    failures, hints the next step's rows (`hint_next`: their hashes are kept for that step), cancels
    aborted requests' hints and reads the counters."""

    def __init__(self, hasher: NgramHasher, rows: RowSource, shard: EngramShard | None = None) -> None:
        self.hasher, self.source, self.shard = hasher, rows, shard
        self._last_step: EngramStep | None = None  # its failures are the runner's to report
        self._hinted: dict[int, HashedToken] = {}  # slot -> its next token, hashed by hint_next

    # -- the model's side ----------------------------------------------------------------------------
    def row_ids(self, batch: ForwardBatch, context: torch.Tensor) -> torch.Tensor:
        """[T, engram layers, columns] int64 whole-table row ids of the step's tokens; advances `context`
        [slots, N-1]. A one-token chunk whose token was hinted in the same look-back is not hashed again."""
        hinted = self._take_hinted()
        per_chunk, advanced = [], []
        tokens = batch.token_ids.tolist()
        slots = torch.tensor([chunk.slot for chunk in batch.chunks], device=context.device)
        held = context[slots].tolist()  # one read of every slot's look-back, not one per sequence
        for chunk, carried in zip(batch.chunks, held):
            carried = self.hasher.empty_context() if chunk.position == 0 else carried
            chunk_tokens = tokens[chunk.rows]
            known = hinted.get(chunk.slot)
            if known is not None and known.fits(chunk_tokens, carried):
                ids, carried = known.row_ids[None], list(known.advanced)
            else:
                ids, carried = self.hasher.row_ids(chunk_tokens, None, carried)
            advanced.append(carried)
            per_chunk.append(torch.from_numpy(ids))
        context[slots] = torch.tensor(advanced, dtype=context.dtype).to(context.device)
        return torch.cat(per_chunk)

    def rewind(self, context: torch.Tensor, slot: int, before: list[int], tokens: list[int]) -> None:
        """A verify chunk's slot back at its accepted position (speculative decoding): its look-back is
        the one `before` the chunk advanced over the `tokens` that stand, not over the rejected drafts
        the forward hashed too."""
        _, carried = self.hasher.row_ids(tokens, None, before)
        context[slot] = torch.tensor(carried, dtype=context.dtype, device=context.device)

    def step_row_ids(self, slots: list[int] | torch.Tensor, token_ids: list[int] | torch.Tensor,
                     positions: list[int] | torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """`row_ids` for a decode step (one token per slot), hashed in one vectorised call: the same
        [N, engram layers, columns] ids and the same advanced look-backs, without a per-sequence loop.
        Given as int64 tensors on the context's device (a graph step's static inputs), they are hashed
        there (`_step_row_ids_on_device`) and the ids stay there."""
        if isinstance(token_ids, torch.Tensor):
            return self._step_row_ids_on_device(slots, token_ids, positions, context)
        index = torch.tensor(slots, device=context.device)
        held = context[index].cpu().numpy()
        held[np.asarray(positions) == 0] = self.hasher.empty_context()  # a sequence at position 0 has no past
        tokens = np.asarray(token_ids, dtype=np.int64)
        row_ids = self._next_row_ids(slots, tokens, held)
        advanced = self.hasher.advance(held, tokens)
        context[index] = torch.from_numpy(advanced).to(device=context.device, dtype=context.dtype)
        return torch.from_numpy(row_ids)

    def _step_row_ids_on_device(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                                context: torch.Tensor) -> torch.Tensor:
        """`step_row_ids` by torch ops on the device that holds the inputs: no host read and a fixed
        number of ops whatever the batch. Hinted hashes are dropped, not matched (matching reads the
        look-backs on the host; hashing again on the device costs less)."""
        self._take_hinted()
        return self.hasher.step_row_ids_tensor(slots, token_ids, positions, context)

    def start(self, row_ids: torch.Tensor) -> EngramStep:
        """Starts this rank's reads of a step's rows (whole-table ids [T, layers, columns]): disk tiers
        read while the layers before the first Engram layer run. The step is the runner's `failed_tokens`
        until the next one starts."""
        own = self._for_source(row_ids)
        self._last_step = self.source.start(dict(enumerate(own.unbind(1))))
        return self._last_step

    def rows(self, step: EngramStep, layer_index: int) -> torch.Tensor:
        """[T, columns (this rank's), head_dim] float32 rows of the `layer_index`-th Engram layer of
        `step`."""
        return self.source.rows(step, layer_index)

    # -- the runner's side ---------------------------------------------------------------------------
    def failed_tokens(self) -> dict[int, str]:
        """Flat batch rows of the last step that got no valid Engram rows from this rank's source (their
        requests must fail), with the reason."""
        return {} if self._last_step is None else dict(self._last_step.failed)

    @property
    def reads_ahead(self) -> bool:
        """Some layer reads from disk: hints (`hint_next`) are worth making."""
        return self.source.reads_ahead

    def hint_next(self, request_ids: list[str], slots: list[int], token_ids: list[int], context: torch.Tensor) -> None:
        """Sampled tokens are the next step's inputs: hashes each (slot's look-back in `context`
        [slots, N-1]) once, keeps the ids for the step that feeds it, and hints the source."""
        held = context[torch.tensor(slots, device=context.device)].cpu().numpy()
        tokens = np.asarray(token_ids, dtype=np.int64)
        row_ids = self.hasher.next_row_ids(tokens, held)
        advanced = self.hasher.advance(held, tokens)
        self._hinted = {
            slot: HashedToken(token, tuple(before), tuple(after), ids)
            for slot, token, before, after, ids in zip(slots, token_ids, held.tolist(), advanced.tolist(), row_ids)
        }
        own = self._for_source(torch.from_numpy(row_ids))
        self.source.hint(request_ids, dict(enumerate(own.unbind(1))))

    def stats(self) -> EngramStats | None:
        """The tiered store's counters; None for the plain in-memory table, which keeps none."""
        return self.source.counters()

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its hints not read yet are dropped."""
        self.source.cancel(request_id)

    def check_integrity(self) -> None:
        """Asserts that the source's tables and row caches are consistent."""
        self.source.check_integrity()

    def close(self) -> None:
        """Stops the source's I/O (the disk tier's thread and reader)."""
        self.source.close()

    def resident_bytes(self) -> int:
        """Memory the tables and row caches hold (the memory plan counts it with the weights)."""
        return self.source.resident_bytes()

    def _take_hinted(self) -> dict[int, HashedToken]:
        """The hinted tokens, for this step only: a later step's slots may hold other sequences."""
        hinted, self._hinted = self._hinted, {}
        return hinted

    def _next_row_ids(self, slots: list[int], tokens: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Row ids [N, layers, columns] of one next token per slot: the hinted ones reused, the rest
        hashed in one vectorised call."""
        hinted, contexts = self._take_hinted(), held.tolist()
        known = [hinted.get(slot) for slot in slots]
        reused = [i for i, k in enumerate(known) if k is not None and k.fits([int(tokens[i])], contexts[i])]
        if not reused:
            return self.hasher.next_row_ids(tokens, held)
        row_ids = np.empty((len(slots), *known[reused[0]].row_ids.shape), dtype=np.int64)
        row_ids[reused] = np.stack([known[i].row_ids for i in reused])
        fresh = sorted(set(range(len(slots))) - set(reused))
        if fresh:
            row_ids[fresh] = self.hasher.next_row_ids(tokens[fresh], held[fresh])
        return row_ids

    def _for_source(self, row_ids: torch.Tensor) -> torch.Tensor:
        return row_ids if self.shard is None else self.shard.source_ids(row_ids)
