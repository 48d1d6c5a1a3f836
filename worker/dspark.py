"""The "dspark" draft proposer (issue 27): DSpark's draft layers (models/dspark.py) over the target's taps,
on V4.1 and on V4 (V4-Flash-0731's draft) alike.

After each step the runner hands over every computed chunk with the target's taps at its forwarded rows
(`ComputedChunk.taps`: the mean stream entering each of the draft's tap layers on V4.1, leaving it on V4,
which the runner keeps because `tap_layers` names them). For every chunk the rows that stand (a prompt
chunk's, a verify chunk's own token and accepted drafts) become context: main_proj of their taps, then
each stage's context key at their position in that stage's ring (only a chunk's last `sliding_window`
rows: the ring holds no more). Rejected rows are never written, so nothing rolls back. A sampling chunk
then drafts: a block of [drawn token, noise ...] after its last kept row through the stages, all
sequences of the step in one batch, and its first K Markov-corrected greedy drafts, cut before the first
position the confidence head scores below `confidence_threshold` (DeepSpec's early stop; 0 keeps them
all). A sampling chunk whose `draft_next` is off (the draft policy has its next chunk verify none) only
writes its context: the rings are all the state a block reads, so the stages, the heads and the read of
the drafts to the host are skipped, and drafting resumes at any step from rings exactly as drafting
would have left them.
Writing the context (main_proj and a key projection per stage over the rows that stand) is the small
part (~10% of a drafting step's proposer time: tiny V4.1, CPU, K = 4, one sequence); deferring it to a
catch-up when drafting resumes would keep each slot's last window of taps and move the work onto the
probe step.

Drafts are the argmax of each position's logits whatever the request's temperature: the runner verifies
a draft by drawing at its position and comparing (rejection sampling against a one-hot draft), which
keeps the target's distribution for any draft chosen before that draw, so greedy drafts only cost
acceptance where sampled ones would have matched, and keep drafting deterministic.

A slot's ring belongs to its request from the request's first computed chunk on: a chunk that does not
continue the slot's last one (a new request, a prefix-cache hit that starts past position 0, a
preempted request computed again) starts the slot's context at its own first position, so a block never
reads another sequence's rows or positions no chunk of its own wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from models.dspark import BlockBatch, DSparkConfig, DSparkDraft, allocate_rings, confident_lengths, ring_bytes
from worker.dspark_graphs import DSparkDraftSteps, DSparkRows
from worker.static_steps import captured_bytes, split_step

if TYPE_CHECKING:  # worker/proposers.py builds this proposer
    from worker.proposers import ComputedChunk


@dataclass
class SlotContext:
    """Whose context a slot's rings hold: the request, its first position there, the position after its
    last."""

    request_id: str
    first: int
    end: int


class DSparkProposer:
    """DSpark's stages as the draft model (`model.dspark`, models/dspark.py attach_dspark), with one ring of
    context keys per stage and slot."""

    needs_streams = False

    def __init__(self, model: torch.nn.Module, num_slots: int, k: int, confidence_threshold: float = 0.0) -> None:
        draft = getattr(model, "dspark", None)
        if not isinstance(draft, DSparkDraft):
            raise ValueError("speculative method 'dspark' needs the draft layers (models/dspark.py attach_dspark)")
        if not 1 <= k <= draft.config.block_size:
            raise ValueError(f"{k} drafts a step: a DSpark block proposes 1 to {draft.config.block_size}")
        self.draft, self.k, self.threshold = draft, k, confidence_threshold
        self.tap_layers = draft.config.tap_layers
        weight = model.lm_head.weight
        # one slot more than the requests': the static draft steps' scratch rows and blocks use it
        self.rings = allocate_rings(draft.config, num_slots + 1, weight.dtype, weight.device)
        self._slots: list[SlotContext | None] = [None] * num_slots
        self.steps: DSparkDraftSteps | None = None

    def device_bytes(self) -> int:
        return self.rings.numel() * self.rings.element_size()

    def use_static_steps(self) -> DSparkDraftSteps:
        """From now on a step's decode chunks draft through fixed-shape steps (worker/dspark_graphs.py), run
        eagerly until `capture_graphs` captures them."""
        num_slots = len(self._slots)
        self.steps = DSparkDraftSteps(self.draft, self.rings, num_slots, self.k, self.threshold, scratch_slot=num_slots)
        return self.steps

    def capture_graphs(self) -> int:
        return captured_bytes(self.use_static_steps)

    def propose(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        return split_step(computed, self._static(computed), self._propose_static, self._propose_eager)

    def _static(self, computed: list[ComputedChunk]) -> list[ComputedChunk]:
        """The chunks the static steps take: decode chunks (one token and its verified drafts) that sampled,
        when one of them drafts next."""
        if self.steps is None:
            return []
        static = [item for item in computed if item.taps is not None and item.next_token is not None
                  and len(item.chunk.token_ids) == 1 and 1 <= item.kept <= self.steps.waves]
        return static if any(item.chunk.draft_next for item in static) else []

    def _propose_static(self, items: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        assert self.steps is not None
        sequences = []
        for item in items:
            chunk = item.chunk
            context = self._context(chunk.request_id, chunk.slot, chunk.position)
            context.end = chunk.position + item.kept
            sequences.append(DSparkRows(chunk.slot, chunk.position, item.taps[: item.kept], item.next_token,
                                        context.first))
        drafted = self.steps.draft(sequences)
        return {item.chunk.request_id: tuple(tokens[:count]) for item, (tokens, count) in zip(items, drafted)
                if item.chunk.draft_next and count}

    def _propose_eager(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        taps, positions, slots, blocks = [], [], [], []
        window = self.rings.shape[2]
        for item in computed:
            if item.taps is None or item.kept == 0:  # nothing forwarded (a whole prompt cached)
                continue
            chunk = item.chunk
            context = self._context(chunk.request_id, chunk.slot, chunk.position)
            end = chunk.position + item.kept
            start = max(chunk.position, end - window)
            taps.append(item.taps[start - chunk.position: item.kept])
            positions.extend(range(start, end))
            slots.extend([chunk.slot] * (end - start))
            context.end = end
            if item.next_token is not None and chunk.draft_next:
                blocks.append((chunk.request_id, (chunk.slot, item.next_token, end - 1, context.first)))
        if not taps:
            return {}
        device = self.rings.device
        self.draft.write_context(torch.cat(taps), torch.tensor(positions, device=device),
                                 torch.tensor(slots, device=device), self.rings)
        if not blocks:
            return {}
        config = self.draft.config
        batch = BlockBatch.build([rows for _, rows in blocks], config.block_size, config.noise_token_id, device)
        drafted = self.draft.draft(batch, self.rings)
        counts = self.confident_lengths(drafted.confidence[:, : self.k]).tolist()
        tokens = drafted.tokens[:, : self.k].tolist()
        return {request_id: tuple(tokens[n][: counts[n]]) for n, (request_id, _) in enumerate(blocks) if counts[n]}

    def confident_lengths(self, confidence: torch.Tensor) -> torch.Tensor:
        """models/dspark.py confident_lengths at this proposer's threshold."""
        return confident_lengths(confidence, self.threshold)

    def _context(self, request_id: str, slot: int, position: int) -> SlotContext:
        """The slot's context record, started afresh at `position` unless the chunk continues it."""
        context = self._slots[slot]
        if context is None or context.request_id != request_id or context.end != position:
            context = self._slots[slot] = SlotContext(request_id, position, position)
        return context


def dspark_proposer_bytes(config: DSparkConfig, num_slots: int, dtype: torch.dtype) -> int:
    """DSparkProposer.device_bytes() for `num_slots` request slots without building it (its rings, with the
    scratch slot): what `python -m server plan` counts."""
    return ring_bytes(config, num_slots + 1, dtype)
