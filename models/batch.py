"""What one forward step runs: a flat batch of tokens from several sequences.

Each sequence contributes one contiguous chunk of new tokens (a prefill chunk or one decode token)
whose positions continue what its cache slot already holds. This is the per-step metadata the
attention layers read; it travels as one object instead of through every layer's signature.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from models.transfer import moved


@dataclass(frozen=True)
class SequenceChunk:
    slot: int  # cache slot of the sequence (its fixed-size state: window rings, partial groups, look-back)
    start: int  # first row of this chunk in the flat token batch
    length: int  # new tokens
    position: int  # position of the first new token == tokens the slot already holds
    # The sequence's block table: page i holds its compressed entries for tokens
    # [i * block_tokens, (i + 1) * block_tokens) in every paged layer. None: the slot's default pages.
    pages: torch.Tensor | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    @property
    def end_position(self) -> int:
        return self.position + self.length


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    chunks: tuple[SequenceChunk, ...]
    logits_rows: torch.Tensor  # [R] rows of the flat batch whose logits are wanted

    @classmethod
    def build(cls, sequences: list[tuple], logits: str | list[list[int]] = "last") -> "ForwardBatch":
        """sequences: (slot, new token ids, cached length[, page ids]). logits: "last", "all", or rows per
        sequence relative to each chunk. Without page ids a chunk uses its slot's default pages
        (ModelCache.allocate without an explicit page count gives every slot max_len worth)."""
        chunks, ids, positions, rows = [], [], [], []
        for index, (slot, tokens, cached, *pages) in enumerate(sequences):
            table = torch.tensor(pages[0], dtype=torch.long) if pages else None
            chunk = SequenceChunk(slot=slot, start=len(ids), length=len(tokens), position=cached, pages=table)
            chunks.append(chunk)
            ids.extend(tokens)
            positions.extend(range(cached, cached + len(tokens)))
            if logits == "last":
                rows.append(chunk.start + chunk.length - 1)
            elif logits == "all":
                rows.extend(range(chunk.start, chunk.start + chunk.length))
            else:
                rows.extend(chunk.start + r for r in logits[index])
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            chunks=tuple(chunks),
            logits_rows=torch.tensor(rows, dtype=torch.long),
        )

    def with_pages(self, default_pages) -> "ForwardBatch":
        """The same batch with every chunk's block table filled in (`default_pages(slot)` where missing)."""
        if all(chunk.pages is not None for chunk in self.chunks):
            return self
        chunks = tuple(
            chunk if chunk.pages is not None else replace(chunk, pages=default_pages(chunk.slot)) for chunk in self.chunks
        )
        return replace(self, chunks=chunks)

    def to(self, device: torch.device | str) -> "ForwardBatch":
        """The batch's index tensors on the model's device (block tables included), copied without
        waiting for the device (models/transfer.py)."""
        if self.token_ids.device == torch.device(device):
            return self
        chunks = tuple(c if c.pages is None else replace(c, pages=moved(c.pages, device)) for c in self.chunks)
        return replace(self, token_ids=moved(self.token_ids, device), positions=moved(self.positions, device),
                       logits_rows=moved(self.logits_rows, device), chunks=chunks)


@dataclass(frozen=True)
class DecodeBatch:
    """A step where every sequence adds exactly one token, as tensors only: the forward over it has
    shapes fixed by (sequences, block-table width), never reads a value on the host, and so can be
    captured once in a CUDA graph and replayed with new contents in the same buffers.

    `waves` > 1: a verify step (speculative decoding), each sequence adding `waves` consecutive tokens
    (its last one and its drafts) with shapes still fixed. The rows are wave-major: wave j holds every
    sequence's j-th token (rows [j * n, (j + 1) * n), n = rows / waves), so a slot appears once a wave
    and the rows of one slot are in position order. What reads state an earlier row of its slot writes
    in the same step (the compressors' and indexer's open groups) runs wave by wave (`wave`); the rest
    (projections, experts, the window ring's append, attention masked by position) runs on all rows."""

    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, the new token's position == tokens its slot already holds
    slots: torch.Tensor  # [B] int64 cache slots (distinct within a wave)
    block_tables: torch.Tensor  # [B, P] int64 pages of each sequence; entries past its length: any page
    waves: int = 1

    def wave(self, j: int) -> "DecodeBatch":
        """Wave j's rows as a one-wave batch (views)."""
        n = self.token_ids.shape[0] // self.waves
        rows = slice(j * n, (j + 1) * n)
        return DecodeBatch(self.token_ids[rows], self.positions[rows], self.slots[rows], self.block_tables[rows])

    @classmethod
    def build(cls, rows: list[tuple[int, int, int, list[int]]], width: int | None = None,
              device: torch.device | str = "cpu") -> "DecodeBatch":
        """rows: (slot, token id, position, page ids); tables padded to `width` with their last page."""
        width = width or max(len(pages) for *_, pages in rows)
        tables = [list(pages) + [pages[-1]] * (width - len(pages)) for *_, pages in rows]
        return cls(
            token_ids=torch.tensor([token for _, token, _, _ in rows], dtype=torch.long, device=device),
            positions=torch.tensor([position for _, _, position, _ in rows], dtype=torch.long, device=device),
            slots=torch.tensor([slot for slot, *_ in rows], dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        )
