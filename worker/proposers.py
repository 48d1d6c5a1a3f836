"""Draft proposers for speculative decoding (issue 27): what suggests the tokens a verify step checks.

After each step the runner tells its proposer what the step computed (`ComputedChunk`: a chunk, how
many of its forwarded tokens stand, the token drawn after them, the target's residual streams at its
rows, or its taps of target layers) and gets back up to K drafts per sampling request, which it reports
as ChunkResult.proposed;
the scheduler may send them back as that request's next drafts. Verification (worker/runner.py) makes
any draft safe: a proposer changes how many tokens a step yields, never which.

- `MTPProposer` ("mtp", V4 / V4-Flash): the checkpoint's MTP layer (models/mtp.py). Every computed row
  at position q (the target's pre-head streams there, and the token at q + 1) goes through the layer,
  prompt chunks included, so its own window state follows the sequence; a verify chunk's rejected
  rows are left out (the layer's ring has K spare rows, so the next step's rows overwrite them, as the
  target's do). The last kept row of a sampling chunk predicts the first draft; K - 1 chained steps the
  rest (argmax: deterministic drafts, which the runner's rejection sampling against a one-hot draft
  verifies exactly). A prompt chunk's last row waits for the next chunk's first token. A decode chunk
  whose `draft_next` is off (the draft policy has its next chunk verify none) runs nothing: its rows
  wait in a bounded buffer a slot (`held_rows`) until the slot drafts again, overflows or runs a
  prompt chunk, and then go through the layer in one chunk, so its cache ends as if they had not
  waited: see MTPProposer.
- `DSparkProposer` ("dspark", V4.1 and V4-Flash-0731; worker/dspark.py): DSpark's draft layers
  (models/dspark.py), a block of drafts a step from the target's taps (the mean stream entering V4.1's
  `tap_layers`, leaving V4's) and the drawn token.
- `NgramProposer` ("ngram", any model; vLLM's prompt lookup): the longest suffix of the sequence, of
  `min_n` to `max_n` tokens, that occurred before; the tokens after its latest earlier occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from contract import ScheduledChunk
from models import DecodeBatch, DeepseekV4, ForwardBatch, ModelConfig
from models.model_v41 import DeepseekV41
from models.mtp import allocate_mtp_cache, greedy_drafts
from models.transfer import on_device
from worker.dspark import DSparkProposer
from worker.mtp_graphs import DraftRows, MTPDraftSteps
from worker.static_steps import captured_bytes, split_step

PROPOSER_METHODS = ("mtp", "ngram", "dspark")


@dataclass(frozen=True)
class ComputedChunk:
    """One chunk as its step left it: `kept` leading forwarded tokens stand (all of a prompt chunk's; a
    verify chunk's own token and its accepted drafts), `next_token` was drawn after them (None: the
    chunk does not sample), `streams` are the target's pre-head residual streams at its forwarded
    tokens [len(forwarded), hc_mult, hidden] (None: not kept), `taps` the mean stream entering each of
    the proposer's `tap_layers` there [len(forwarded), len(tap_layers), hidden] (None: not kept)."""

    chunk: ScheduledChunk
    kept: int
    next_token: int | None
    streams: torch.Tensor | None = None
    taps: torch.Tensor | None = None
    pre: torch.Tensor | None = None  # V4.1: the last pre mixes at the forwarded tokens [len(forwarded), hc_mult]

    @property
    def forwarded(self) -> tuple[int, ...]:
        return self.chunk.token_ids + self.chunk.draft_token_ids


class DraftProposer(Protocol):
    """Proposes each sampling request's next drafts from what a step computed."""

    # the proposer reads the target's pre-head residual streams (the runner keeps them then)
    needs_streams: bool
    # target layers whose incoming streams (their mean) the proposer reads (the runner keeps them; () none)
    tap_layers: tuple[int, ...]

    def propose(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        """request id -> its drafts (at most the proposer's K), for the chunks that sampled with
        `chunk.draft_next` on. After every other chunk it only brings its own state (cache, context, history)
        over the rows that stand, exactly as drafting would have left it, so drafting can resume at any step."""
        ...

    def device_bytes(self) -> int:
        """Device memory the proposer holds beside the target's cache (its own cache and buffers, sized
        by the slots): the memory plan counts it with the slots' fixed state, so KV pages never take it."""
        ...

    def capture_graphs(self) -> int:
        """Captures the proposer's drafting as CUDA graphs (a runner whose decode steps replay graphs calls
        it once, after capturing its own); returns the device bytes that took (the memory plan's
        workspace counts them): 0 where the proposer drafts eagerly."""
        ...


class NgramProposer:
    """Prompt lookup over each slot's tokens, as this runner computed them (a prefix-cache hit's cached
    tokens are not seen: the history starts at the first computed chunk)."""

    needs_streams = False
    tap_layers: tuple[int, ...] = ()

    def __init__(self, num_slots: int, k: int, min_n: int = 1, max_n: int = 4, window: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes {min_n}..{max_n}: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k, self.min_n, self.max_n, self.window = k, min_n, max_n, window
        # per slot: the position of its first known token, and the tokens from there on
        self.history: list[tuple[int, list[int]]] = [(0, []) for _ in range(num_slots)]

    def device_bytes(self) -> int:
        return 0  # the histories are host lists

    def capture_graphs(self) -> int:
        return 0  # a host lookup

    def propose(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        drafts = {}
        for item in computed:
            chunk = item.chunk
            start, tokens = self.history[chunk.slot]
            if not start <= chunk.position <= start + len(tokens):  # a prefix-cache hit, or a new request
                start, tokens = chunk.position, []
                self.history[chunk.slot] = (start, tokens)
            del tokens[chunk.position - start:]
            tokens.extend(item.forwarded[: item.kept])
            if item.next_token is not None and chunk.draft_next:
                found = self.lookup(tokens + [item.next_token])
                if found:
                    drafts[chunk.request_id] = found
        return drafts

    def lookup(self, tokens: list[int]) -> tuple[int, ...]:
        """The k tokens after the latest earlier occurrence of the longest matching suffix (max_n down
        to min_n tokens), searched in the last `window` tokens; () when none occurs."""
        recent = tokens[-self.window:]
        for n in range(min(self.max_n, len(recent) - 1), self.min_n - 1, -1):
            suffix = recent[-n:]
            for start in range(len(recent) - n - 1, -1, -1):
                if recent[start: start + n] == suffix:
                    return tuple(recent[start + n: start + n + self.k])
        return ()


# scheduler/spec_policy.py PROBE_EVERY (worker/ does not import scheduler/; tests/test_spec_drafting_off.py ties them)
PROBE_EVERY_STEPS = 16


def held_rows(k: int) -> int:
    """Rows of layer input an MTP proposer drafting `k` tokens holds a slot (see MTPProposer): a sequence
    that takes drafts drafts at least once in PROBE_EVERY steps, and the PROBE_EVERY - 1 chunks before
    that draft nothing, the first with up to k accepted drafts (k + 1 rows), the others with none (1 row:
    nothing was proposed after the chunk before them)."""
    return PROBE_EVERY_STEPS + k - 1


_Rows = tuple[torch.Tensor, "torch.Tensor | None"]  # the target's streams at some rows, and V4.1's pre mixes there


@dataclass
class _Held:
    """The rows a slot holds for its layer, in its buffer's first `rows` rows: the request's rows from
    `position` on, `tokens` the token after each (the last row's missing while it waits for its token)."""

    request_id: str
    position: int
    tokens: list[int]
    rows: int

    @property
    def end(self) -> int:  # the position after the last held row: the next chunk's, if it continues
        return self.position + self.rows


class MTPProposer:
    """V4's MTP layer as the draft model, with its own cache (one window ring per request slot).

    A decode chunk whose `draft_next` is off (the draft policy has its next chunk verify none) runs no
    device work of the proposer beyond one copy: its rows that stand (the target's streams [hc_mult,
    hidden] there, and the token after each, a host int) are held in a per-slot buffer of the layer's
    inputs, `held_rows(K)` rows a slot. The next chunk of the slot that drafts (a probe step, drafting
    turned back on), that does not fit, or that is not a decode (a prompt chunk: prefill is compute-bound,
    its rows run through the layer as they come) runs the layer over the held rows and its own, in one
    chunk, in order: the layer's cache ends exactly as if every row had run as it came (the chain writes
    only spare rows past the last kept one, which the next rows the layer runs overwrite), so drafts
    equal the layer run afresh. With whole-step probes a sequence that takes drafts drafts at least every
    PROBE_EVERY steps, which `held_rows` covers; one that never does (a grammar, min_tokens) or misses a
    probe runs the layer once its rows would overflow the buffer. A prompt chunk's last row waits in the
    buffer too, for the next chunk's first token. Held rows belong to a request and a position: the
    slot's next chunk drops them unless it is the same request's, continuing at their end (a restart
    after preemption, a new request in the slot after an abort or a finish, one resuming from a
    prefix-cache point exactly at their end), so no stale row ever reaches the layer. Nothing on this path reads the device from the host. The
    buffer is device memory beside the cache (`device_bytes`, `mtp_proposer_bytes`): on V4-Flash (hc_mult
    4, hidden 4096, bf16) 32 KiB a row, 544 KiB a slot at K = 2, where the layer's own cache is ~130 KiB.

    On a runner that replays CUDA graphs (`capture_graphs`), a step's decode chunks whose slots hold no rows
    draft through graphs of fixed shape (worker/mtp_graphs.py: their rows as a verify batch, the head at
    each last standing row, the chain), when one of them drafts next; the rest of the step (prompt
    chunks, slots with held rows) runs the eager path above. The cache has one slot more than the
    requests', which those graphs' scratch rows write.
    """

    needs_streams = True
    tap_layers: tuple[int, ...] = ()

    def __init__(self, model: DeepseekV4 | DeepseekV41, num_slots: int, max_model_len: int, k: int) -> None:
        if model.mtp is None:
            raise ValueError("speculative method 'mtp' needs the checkpoint's MTP layer (load_model(mtp=True))")
        self.layer = model.mtp[0]
        self.k = k
        dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
        # one slot more than the requests': the static draft steps' scratch rows write it
        self.cache = allocate_mtp_cache(model.config, num_slots + 1, max_model_len, dtype=dtype, device=device,
                                        draft_tokens=k)
        config = self.config = model.config
        self.held_streams = torch.zeros(num_slots, held_rows(k), config.hc_mult, config.hidden_size, dtype=dtype,
                                        device=device)
        self.held_pre = (torch.zeros(num_slots, held_rows(k), config.hc_mult, device=device) if config.is_v41
                         else None)
        self._held: list[_Held | None] = [None] * num_slots
        self.steps: MTPDraftSteps | None = None

    def device_bytes(self) -> int:
        held = [self.held_streams] + ([self.held_pre] if self.held_pre is not None else [])
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in held)

    def use_static_steps(self) -> MTPDraftSteps:
        """From now on a step's decode chunks draft through fixed-shape steps (worker/mtp_graphs.py), run
        eagerly until `capture_graphs` captures them."""
        num_slots = len(self._held)
        self.steps = MTPDraftSteps(self.layer, self.cache, self.config, num_slots, self.k, scratch_slot=num_slots)
        return self.steps

    def capture_graphs(self) -> int:
        return captured_bytes(self.use_static_steps)

    def propose(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        return split_step(computed, self._static(computed), self._propose_static, self._propose_eager)

    def _static(self, computed: list[ComputedChunk]) -> list[ComputedChunk]:
        """The chunks the static steps draft after: decode chunks (one token and its verified drafts) that
        sampled, whose slot holds no rows, when one of them drafts next (else they all wait in the held
        rows, which is cheaper than a replay)."""
        if self.steps is None:
            return []
        static = [item for item in computed
                  if item.streams is not None and item.next_token is not None and len(item.chunk.token_ids) == 1
                  and item.kept <= self.steps.waves and self._held[item.chunk.slot] is None]
        return static if any(item.chunk.draft_next for item in static) else []

    def _propose_static(self, items: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        assert self.steps is not None
        sequences = [DraftRows(item.chunk.slot, item.chunk.position, (*item.forwarded[1: item.kept], item.next_token),
                               *self._rows(item)) for item in items]
        drafts = self.steps.draft(sequences)
        return {item.chunk.request_id: tuple(row) for item, row in zip(items, drafts) if item.chunk.draft_next}

    def _propose_eager(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        sequences, inputs, sampling, holds = [], [], [], []
        for item in computed:
            if item.streams is None:  # nothing forwarded (a whole prompt cached)
                continue
            chunk, slot = item.chunk, item.chunk.slot
            held = self._continued(chunk)
            if held.rows > len(held.tokens):  # the waiting row's token is this chunk's first
                held.tokens.append(item.forwarded[0])
            rows = self._rows(item)
            tokens = held.tokens + list(item.forwarded[1: item.kept])
            if item.next_token is not None:
                tokens.append(item.next_token)
            total = held.rows + item.kept
            if self._holds(item, total):
                holds.append((slot, held.rows, rows))
                self._held[slot] = _Held(chunk.request_id, held.position, tokens, total)
                continue
            if held.rows:
                inputs.append(_cut(self._held_rows(slot), 0, held.rows))
            inputs.append(_cut(rows, 0, len(tokens) - held.rows))
            if item.next_token is None:  # the last row's next token comes with the next chunk
                holds.append((slot, 0, _cut(rows, item.kept - 1, item.kept)))
                self._held[slot] = _Held(chunk.request_id, held.position + len(tokens), [], 1)
            if tokens:
                sequences.append((slot, tokens, held.position))
                if item.next_token is not None and chunk.draft_next:
                    sampling.append((len(sequences) - 1, chunk.request_id))
        # read the held rows before the holds overwrite any
        streams, pre = (torch.cat([s for s, _ in inputs]), _cat_pre([p for _, p in inputs])) if inputs else (None, None)
        self._hold(holds)
        if not sampling:
            if sequences:
                self.layer(streams, ForwardBatch.build(sequences), self.cache, pre=pre)
            return {}
        batch = ForwardBatch.build(sequences, logits=[[len(tokens) - 1] if any(i == index for i, _ in sampling) else []
                                                      for index, (_, tokens, _) in enumerate(sequences)])
        logits, out, out_pre = self.layer(streams, batch, self.cache, pre=pre)
        firsts = logits.argmax(dim=-1)
        drafts = firsts[:, None]
        if self.k > 1:
            last = [sequences[index] for index, _ in sampling]
            ends = [batch.chunks[index].start + batch.chunks[index].length - 1 for index, _ in sampling]
            decode = DecodeBatch.build([(slot, 0, position + len(tokens), list(self.cache.default_pages(slot)))
                                        for slot, tokens, position in last], device=firsts.device)
            decode = DecodeBatch(firsts, decode.positions, decode.slots, decode.block_tables)
            chained, _ = greedy_drafts(self.layer, out[ends], decode, self.cache, self.k - 1,
                                       None if out_pre is None else out_pre[ends])
            drafts = torch.cat([drafts, chained], dim=1)
        values = drafts.tolist()
        return {request_id: tuple(values[row]) for row, (_, request_id) in enumerate(sampling)}

    def _rows(self, item: ComputedChunk) -> _Rows:
        """The chunk's standing rows as the layer reads them: the target's streams (and V4.1's pre mixes)."""
        if self.held_pre is not None and item.pre is None:
            raise ValueError("a V4.1 MTP proposer reads the target's last pre mixes with its streams")
        return item.streams[: item.kept], None if item.pre is None else item.pre[: item.kept]

    def _held_rows(self, slot: int) -> _Rows:
        return self.held_streams[slot], None if self.held_pre is None else self.held_pre[slot]

    def _continued(self, chunk: ScheduledChunk) -> _Held:
        """The rows the chunk's slot holds, taken out of it: its own when the chunk continues them, else none
        (dropped: the slot's sequence restarted or another request took it)."""
        held, self._held[chunk.slot] = self._held[chunk.slot], None
        if held is None or held.request_id != chunk.request_id or held.end != chunk.position:
            return _Held(chunk.request_id, chunk.position, [], 0)
        return held

    def _holds(self, item: ComputedChunk, rows: int) -> bool:
        """Whether a chunk's rows wait in the buffer (`rows` with the held ones before them): a decode chunk
        (one token, its drafts) drafting nothing next, while they fit."""
        chunk = item.chunk
        return (item.next_token is not None and not chunk.draft_next and len(chunk.token_ids) == 1
                and rows <= self.held_streams.shape[1])

    def _hold(self, holds: list[tuple[int, int, _Rows]]) -> None:
        """Copies each (slot, first row, rows) into the buffers: one gather and one indexed copy a step each."""
        if not holds:
            return
        width = self.held_streams.shape[1]
        index = [slot * width + first + i for slot, first, (rows, _) in holds for i in range(rows.shape[0])]
        index = on_device(index, torch.long, self.held_streams.device)
        flat = self.held_streams.view(-1, *self.held_streams.shape[2:])
        flat.index_copy_(0, index, torch.cat([rows for _, _, (rows, _) in holds]))
        if self.held_pre is not None:
            flat_pre = self.held_pre.view(-1, self.held_pre.shape[2])
            flat_pre.index_copy_(0, index, torch.cat([pre for _, _, (_, pre) in holds]))


def _cut(rows: _Rows, start: int, stop: int) -> _Rows:
    streams, pre = rows
    return streams[start:stop], None if pre is None else pre[start:stop]


def _cat_pre(pres: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if pres[0] is None else torch.cat(pres)


def mtp_proposer_bytes(model_config: ModelConfig, num_slots: int, max_model_len: int, k: int, dtype: torch.dtype) -> int:
    """MTPProposer.device_bytes() for a model of `model_config` without building it (the layer's cache
    on the meta device, and the held rows): what `python -m server plan` counts."""
    cache = allocate_mtp_cache(model_config, num_slots + 1, max_model_len, dtype=dtype, device="meta",
                               draft_tokens=k)  # the scratch slot too
    held = num_slots * held_rows(k) * model_config.hc_mult * model_config.hidden_size * dtype.itemsize
    if model_config.is_v41:  # the last pre mixes beside the streams, float32
        held += num_slots * held_rows(k) * model_config.hc_mult * 4
    return cache.nbytes() + held


def build_proposer(method: str, model: DeepseekV4, num_slots: int, max_model_len: int, k: int,
                   prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                   confidence_threshold: float = 0.0) -> DraftProposer:
    """The proposer of `method` (one of PROPOSER_METHODS) drafting `k` tokens (dspark: with the draft
    layers attached to `model`, models/dspark.py attach_dspark)."""
    if method == "dspark":
        return DSparkProposer(model, num_slots, k, confidence_threshold)
    if method == "mtp":
        return MTPProposer(model, num_slots, max_model_len, k)
    if method == "ngram":
        return NgramProposer(num_slots, k, prompt_lookup_min, prompt_lookup_max)
    raise ValueError(f"speculative method {method!r}: one of {PROPOSER_METHODS}")
