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
  verifies exactly). A prompt chunk's last row waits for the next chunk's first token (`_waiting`).
  After a sampling chunk whose `draft_next` is off (the draft policy has its next chunk verify none) the
  rows still go through the layer, no logits row, no chain, no read to the host: see MTPProposer.
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
from models.mtp import allocate_mtp_cache, greedy_drafts
from worker.dspark import DSparkProposer

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


class MTPProposer:
    """V4's MTP layer as the draft model, with its own cache (one window ring per request slot).

    After a sampling chunk whose `draft_next` is off it runs the layer over the chunk's rows that stand as
    over a prompt chunk's (what writes its cache), and skips the head, the K - 1 chained steps and the
    read of the drafts to the host (the sync): that leaves the cache exactly as drafting would (the chain
    writes only spare rows past the last kept one, which the next step's rows overwrite), at ~40% of a
    drafting step's proposer time (tiny V4, CPU, K = 2, 1 and 8 sequences). Skipping the layer too and
    catching the cache up when drafting resumes would need the layer's inputs of every skipped row, the
    target's streams [hc_mult, hidden], copied out each step into a ring per slot: a window of them for a
    sliding MTP layer (4 MiB a slot on V4-Flash, held beside the cache), every row since the last draft
    for a compressed one (unbounded); and the policy turns drafting off at large batches, where one chunk
    in PROBE_EVERY still probes, so nearly every step would run a catch-up forward anyway.
    """

    needs_streams = True
    tap_layers: tuple[int, ...] = ()

    def __init__(self, model: DeepseekV4, num_slots: int, max_model_len: int, k: int) -> None:
        if model.mtp is None:
            raise ValueError("speculative method 'mtp' needs the checkpoint's MTP layer (load_model(mtp=True))")
        self.layer = model.mtp[0]
        self.k = k
        dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
        self.cache = allocate_mtp_cache(model.config, num_slots, max_model_len, dtype=dtype, device=device,
                                        draft_tokens=k)
        config = model.config
        # a prompt chunk's last row (its streams, position) until the next chunk brings the token after it
        self._waiting_streams = torch.zeros(num_slots, config.hc_mult, config.hidden_size, dtype=dtype, device=device)
        self._waiting_position: list[int | None] = [None] * num_slots

    def device_bytes(self) -> int:
        waiting = self._waiting_streams
        return self.cache.nbytes() + waiting.numel() * waiting.element_size()

    def propose(self, computed: list[ComputedChunk]) -> dict[str, tuple[int, ...]]:
        sequences, inputs, sampling = [], [], []
        for item in computed:
            if item.streams is None:  # nothing forwarded (a whole prompt cached)
                continue
            chunk, slot = item.chunk, item.chunk.slot
            rows = item.streams[: item.kept]
            following = list(item.forwarded[1: item.kept]) + ([item.next_token] if item.next_token is not None else [])
            position = chunk.position
            if self._waiting_position[slot] == position - 1:  # the waiting row's next token is this chunk's first
                rows = torch.cat([self._waiting_streams[slot][None], rows])
                following = [item.forwarded[0], *following]
                position -= 1
            self._waiting_position[slot] = None
            if item.next_token is None:  # the last row's next token comes with the next chunk
                self._waiting_streams[slot] = rows[-1]
                self._waiting_position[slot] = position + len(following)
                rows = rows[:-1]
            if following:
                sequences.append((slot, following, position))
                inputs.append(rows)
                if item.next_token is not None and chunk.draft_next:
                    sampling.append((len(sequences) - 1, chunk.request_id))
        if not sampling:
            if sequences:
                self.layer(torch.cat(inputs), ForwardBatch.build(sequences), self.cache)
            return {}
        batch = ForwardBatch.build(sequences, logits=[[len(tokens) - 1] if any(i == index for i, _ in sampling) else []
                                                      for index, (_, tokens, _) in enumerate(sequences)])
        logits, out = self.layer(torch.cat(inputs), batch, self.cache)
        firsts = logits.argmax(dim=-1)
        drafts = firsts[:, None]
        if self.k > 1:
            last = [sequences[index] for index, _ in sampling]
            ends = [batch.chunks[index].start + batch.chunks[index].length - 1 for index, _ in sampling]
            decode = DecodeBatch.build([(slot, 0, position + len(tokens), list(self.cache.default_pages(slot)))
                                        for slot, tokens, position in last], device=firsts.device)
            decode = DecodeBatch(firsts, decode.positions, decode.slots, decode.block_tables)
            chained, _ = greedy_drafts(self.layer, out[ends], decode, self.cache, self.k - 1)
            drafts = torch.cat([drafts, chained], dim=1)
        values = drafts.tolist()
        return {request_id: tuple(values[row]) for row, (_, request_id) in enumerate(sampling)}


def mtp_proposer_bytes(model_config: ModelConfig, num_slots: int, max_model_len: int, k: int, dtype: torch.dtype) -> int:
    """MTPProposer.device_bytes() for a model of `model_config` without building it (the layer's cache
    on the meta device, and the waiting rows): what `python -m server plan` counts."""
    cache = allocate_mtp_cache(model_config, num_slots, max_model_len, dtype=dtype, device="meta", draft_tokens=k)
    waiting = num_slots * model_config.hc_mult * model_config.hidden_size * dtype.itemsize
    return cache.nbytes() + waiting


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
