"""The DSpark proposer's drafting after a step of decode chunks, in fixed shapes: one CUDA graph per batch
bucket (issue 27 item 4), as worker/mtp_graphs.py does for MTP.

Eagerly (worker/dspark.py) a step's drafting writes the context of the rows that stand into every stage's
ring and runs a block through the stages, from host lists built each step. After a step of decode chunks
the rows that stand are at most 1 + K a sequence, so:
- context rows: 1 + K a sequence, the rows that did not stand (and the bucket's padding sequences')
  written into a scratch slot's ring that no sequence reads;
- blocks: one a sequence ([drawn token, noise ...] after its last standing row, its context from the
  first position its slot holds for it), the padding sequences' in the scratch slot;
- DeepSpec's confidence cut in the body, so a replay returns each sequence's K drafts and how many of
  them to keep.
One int64 upload (rows, sequences, stream destinations), one indexed copy of the taps, one replay, one
read. Uncaptured (CPU, tests) `draft` runs the same body eagerly; it is the eager path's arithmetic on
the same rows (writes to distinct ring rows, a block per sequence), so the drafts are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.dspark import BlockBatch, DSparkDraft, confident_lengths
from worker.static_steps import StaticDraftSteps

POSITION, SLOT = 0, 1  # columns of the context rows
SEQ_SLOT, SEQ_TOKEN, SEQ_LAST, SEQ_FIRST = 0, 1, 2, 3  # columns of the sequences


@dataclass(frozen=True)
class DSparkRows:
    """One decode chunk as the static steps take it: its standing rows' taps [rows, taps, D] from
    `position` on in `slot`, the token drawn after them, and the first position the slot's ring holds
    for the sequence."""

    slot: int
    position: int
    taps: torch.Tensor
    next_token: int
    first: int


class DSparkDraftSteps(StaticDraftSteps):
    def __init__(self, draft: DSparkDraft, rings: torch.Tensor, max_batch: int, k: int, threshold: float,
                 scratch_slot: int) -> None:
        """`rings`: the proposer's (models/dspark.py allocate_rings), whose `scratch_slot` no request owns."""
        rows = max_batch * (1 + k)
        # the flat inputs: [rows, 2] context rows, [max_batch, 4] sequences, [rows] tap destinations
        self.seq_at = 2 * rows
        self.dest_at = self.seq_at + 4 * max_batch
        super().__init__(max_batch, k, self.dest_at + rows, rings.device)
        self.layers, self.rings, self.threshold, self.scratch_slot = draft, rings, threshold, scratch_slot
        config = draft.config
        self.taps = torch.zeros(rows, len(config.tap_layers), config.layers.hidden_size, dtype=rings.dtype,
                                device=rings.device)
        self.noise = torch.full((max_batch, config.block_size - 1), config.noise_token_id, dtype=torch.long,
                                device=rings.device)
        self.offsets = torch.arange(1, config.block_size + 1, device=rings.device)

    @torch.inference_mode()
    def draft(self, sequences: list[DSparkRows]) -> list[tuple[list[int], int]]:
        """Each sequence's K drafts and how many of them its confidence keeps, writing its standing rows'
        context first."""
        size = self.start(len(sequences))
        rows = self.host[: self.seq_at].reshape(self.max_rows, 2)
        seqs = self.host[self.seq_at: self.dest_at].reshape(-1, 4)
        destinations = []
        for i, sequence in enumerate(sequences):
            count = sequence.taps.shape[0]
            at = self.rows_at(size, i, count)
            rows[at, POSITION] = range(sequence.position, sequence.position + count)
            rows[at, SLOT] = sequence.slot
            seqs[i] = sequence.slot, sequence.next_token, sequence.position + count - 1, sequence.first
            destinations += at
        self.host[self.dest_at: self.dest_at + len(destinations)] = destinations
        gathers = [(self.taps, torch.cat([sequence.taps for sequence in sequences]))]
        values = self.run(size, gathers, self.dest_at, len(destinations))[: len(sequences)].tolist()
        return [(row[: self.k], row[self.k]) for row in values]

    @torch.inference_mode()
    def body(self, size: int) -> torch.Tensor:
        """What bucket `size`'s graph runs: int64 [size, K + 1], each sequence's K drafts then how many to keep."""
        count = size * self.waves
        rows = self.inputs[: self.seq_at].view(self.max_rows, 2)[:count]
        self.layers.write_context(self.taps[:count], rows[:, POSITION], rows[:, SLOT], self.rings)
        seqs = self.inputs[self.seq_at: self.dest_at].view(-1, 4)[:size]
        last = seqs[:, SEQ_LAST]
        tokens = torch.cat([seqs[:, SEQ_TOKEN, None], self.noise[:size]], dim=1).flatten()
        positions = (last[:, None] + self.offsets).flatten()
        batch = BlockBatch(tokens, positions, seqs[:, SEQ_SLOT], last, seqs[:, SEQ_FIRST], self.offsets.shape[0])
        drafted = self.layers.draft(batch, self.rings)
        keep = confident_lengths(drafted.confidence[:, : self.k], self.threshold)
        return torch.cat([drafted.tokens[:, : self.k], keep[:, None]], dim=1)

    def fill_scratch(self, size: int) -> None:
        """Every context row of bucket `size` a scratch row, every sequence a scratch block."""
        rows = self.host[: self.seq_at].reshape(self.max_rows, 2)[: size * self.waves]
        rows[:, POSITION], rows[:, SLOT] = 0, self.scratch_slot
        seqs = self.host[self.seq_at: self.dest_at].reshape(-1, 4)[:size]
        seqs[:] = self.scratch_slot, 0, 0, 0
