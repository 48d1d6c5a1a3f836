"""The MTP proposer's drafting after a step of decode chunks, in fixed shapes: one CUDA graph per batch
bucket (issue 27 item 4).

Eagerly (worker/proposers.py, MTPProposer) a step's drafting is the layer's chunked forward over the rows
that stand, then K - 1 chained decode steps, each a few hundred small kernels launched from Python: on the
tiny V4 at one stream that was 6.8 ms a step against a plain step's 0.6 ms (the fifteenth session's H200
figures), which no acceptance rate pays back. After a step of decode chunks (each its last token and the
drafts it verified) the rows have a fixed shape, at most 1 + K a sequence, so:

- The layer runs them as a verify batch (models/batch.py DecodeBatch, `waves` = 1 + K, wave-major): a
  sequence's standing rows at their positions in its slot, the rest of its waves scratch rows (token 0 at
  position 0 in a scratch slot no request owns; the bucket's padding sequences are scratch rows only).
  Rows that did not stand never touch a sequence's state, as in the eager path, which leaves them out.
- The first draft is the head's argmax at each sequence's last standing row (a gather by a device index:
  only those rows read the head's weights), the other K - 1 are chained decode steps (models/mtp.py
  `greedy_drafts`) from there, writing only the ring's spare rows past that row, as the eager chain does.
- Inputs: one int64 buffer uploaded in one copy a step (per row the token after it, its position and
  slot; per sequence the index of its last standing row; per standing row the static row its streams go
  to), the target's streams (V4.1: and their last pre mixes, models/mtp_v41.py) gathered into the static
  rows by one indexed copy each. Nothing in the
  body reads the host, so `capture` makes each batch bucket one graph; uncaptured (CPU, tests) `draft`
  runs the same body eagerly.

The drafts equal the eager path's up to float-sum order: the decode path and the chunked forward agree to
float32 rounding (tests/test_decode_path.py), so a draft can differ only at a near tie of the layer's
logits, which only changes how many drafts verification accepts, never a token the target emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import DecodeBatch, ModelCache, ModelConfig
from models.mtp import MTPLayer, greedy_drafts
from models.mtp_v41 import MTPLayerV41
from worker.static_steps import StaticDraftSteps

TOKEN, POSITION, SLOT = 0, 1, 2  # columns of the row inputs


@dataclass(frozen=True)
class DraftRows:
    """One decode chunk's standing rows as the layer takes them: from `position` on in `slot`, the token
    after each row (the last one: the token the step drew) and the target's streams there
    [len(tokens), hc_mult, hidden]."""

    slot: int
    position: int
    tokens: tuple[int, ...]
    streams: torch.Tensor
    pre: torch.Tensor | None = None  # V4.1: the target's last pre mixes there [len(tokens), hc_mult]


class MTPDraftSteps(StaticDraftSteps):
    def __init__(self, layer: MTPLayer | MTPLayerV41, cache: ModelCache, config: ModelConfig, max_batch: int, k: int,
                 scratch_slot: int) -> None:
        """`cache`: the layer's own (models/mtp.py allocate_mtp_cache, with `k` draft rows), whose
        `scratch_slot` no request owns; `config`: the target's."""
        weight = layer.h_proj.weight
        rows = max_batch * (1 + k)
        # the flat inputs: [rows, 3] row inputs, [max_batch] each sequence's last row, [rows] destinations
        self.last_at = 3 * rows
        self.dest_at = self.last_at + max_batch
        super().__init__(max_batch, k, self.dest_at + rows, weight.device)
        self.layer, self.cache, self.scratch_slot = layer, cache, scratch_slot
        # each slot's pages of the layer's cache (fixed: the cache hands a slot its own)
        self.pages = torch.stack([cache.default_pages(slot) for slot in range(scratch_slot + 1)]).to(weight.device)
        self.streams = torch.zeros(rows, config.hc_mult, config.hidden_size, dtype=weight.dtype, device=weight.device)
        self.pre = torch.zeros(rows, config.hc_mult, device=weight.device) if config.is_v41 else None

    @torch.inference_mode()
    def draft(self, sequences: list[DraftRows]) -> list[list[int]]:
        """The K greedy drafts after each sequence's rows (at most `max_batch` sequences of at most 1 + K
        rows), appending the rows to the layer's state."""
        size = self.start(len(sequences))
        rows = self.host[: self.last_at].reshape(self.max_rows, 3)
        destinations = []
        for i, sequence in enumerate(sequences):
            count = len(sequence.tokens)
            at = self.rows_at(size, i, count)
            rows[at, TOKEN] = sequence.tokens
            rows[at, POSITION] = range(sequence.position, sequence.position + count)
            rows[at, SLOT] = sequence.slot
            self.host[self.last_at + i] = at[-1]
            destinations += at
        self.host[self.dest_at: self.dest_at + len(destinations)] = destinations
        gathers = [(self.streams, torch.cat([sequence.streams for sequence in sequences]))]
        if self.pre is not None:
            gathers.append((self.pre, torch.cat([sequence.pre for sequence in sequences])))
        return self.run(size, gathers, self.dest_at, len(destinations))[: len(sequences)].tolist()

    @torch.inference_mode()
    def body(self, size: int) -> torch.Tensor:
        """What bucket `size`'s graph runs: int64 drafts [size, K] from the static inputs."""
        count = size * self.waves
        rows = self.inputs[: self.last_at].view(self.max_rows, 3)[:count]
        tokens, positions, slots = rows[:, TOKEN], rows[:, POSITION], rows[:, SLOT]
        batch = DecodeBatch(tokens, positions, slots, self.pages[slots], self.waves)
        out, out_pre = self.layer.advance(self.streams[:count], batch, self.cache,
                                          None if self.pre is None else self.pre[:count])
        last = self.inputs[self.last_at: self.last_at + size]
        streams, pre = out[last], None if out_pre is None else out_pre[last]
        first = self.layer.draft_logits(streams, pre).argmax(dim=-1)
        if self.k == 1:
            return first[:, None]
        chain = DecodeBatch(first, positions[last] + 1, slots[last], self.pages[slots[last]])
        chained, _ = greedy_drafts(self.layer, streams, chain, self.cache, self.k - 1, pre)
        return torch.cat([first[:, None], chained], dim=1)

    def fill_scratch(self, size: int) -> None:
        """Every row of bucket `size` a scratch row, every sequence's last row its first wave's."""
        rows = self.host[: self.last_at].reshape(self.max_rows, 3)[: size * self.waves]
        rows[:, TOKEN], rows[:, POSITION], rows[:, SLOT] = 0, 0, self.scratch_slot
        self.host[self.last_at: self.last_at + size] = range(size)
