"""Prefix cache: state points a later request can resume from, any position, shared pages.

A hybrid-attention sequence has two kinds of state (ARCHITECTURE.md): paged compressed KV, which a
later request can share page by page, and a fixed per-slot state (sliding-window rings, compressors'
open groups, indexer rings, the Engram look-back) that holds only the *latest* position. Sharing pages
alone is therefore not enough to resume: the fixed state at the hit position is needed too, and it
cannot be recomputed from the pages (the window ring holds raw K of the last `sliding_window`
tokens of every layer, which no page keeps; recomputing them needs the ring before them, and so on
back to position 0).

So the cache stores *state points*: (salt, the token ids [0, p)) -> a snapshot of the fixed state at p
(a copy of the request's slot into a spare snapshot slot of the model cache) plus references on the
pages covering [0, p). A request that starts with a point's tokens resumes at p: its slot is restored
from the snapshot, the full pages are shared (reference counted), the partial last page (p need not be
page-aligned) is copied, since the request writes further entries into it. The model then computes
only tokens p.., bitwise as if it had computed all of them (the deterministic tests check it).

Points are taken where later requests are likely to resume, measured on multi-turn chats:
- where a request finishes (prompt + output but the last sampled token): the next turn of a chat
  whose template re-renders the answer as generated continues right there;
- at the end of each prompt chunk, the prompt's end included;
- at the request's `cache_boundary`, when the front end sets one: the chat layer puts it before the
  generation prompt (`<think>`), because the next turn re-renders this assistant turn without its
  reasoning (`</think>answer`), so the history diverges exactly there;
- where a request is preempted (its recomputation resumes from it).
Measured (`python -m bench.prefix --state-costs`): restoring beats recomputing by far (on the CPU
the tiny model copies a snapshot in 0.2 ms and computes a 128-token page in ~200 ms), but a snapshot
is large: one V4-Flash slot's fixed state is 11.7 MB against 0.88 MB for a page of its KV (V4.1-Flash:
5.3 MB against 0.41 MB), so a snapshot at every page boundary would take 13x the memory of the KV it
serves, and would still miss the exact position where a turn diverges. Hence points only where
requests diverge (the list above), and the tail after a hit is recomputed.

Lookup indexes points by the chained hash of their full pages (with the tenant's salt), so finding the
longest usable point costs one dict probe per page of the prompt; a candidate's tokens are then
compared exactly, so a hash collision can never serve wrong state. When snapshot slots or pages run
out, points are evicted by value (`ValueOrder`, GreedyDual: long, often-hit prefixes outlive short
unused ones; the tiers below use the same order, scheduler/prefix_tiers.py) and, with the host tier
on, spilled into it rather than lost (`on_evict`); a page is only ever freed when no request holds it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class StatePoint:
    salt: str | None
    tokens: tuple[int, ...]  # the point resumes at position len(tokens)
    snapshot: int  # model-cache slot holding the fixed state at that position
    pages: tuple[int, ...]  # pages covering the tokens (the last one partial unless aligned)
    # the snapshot also holds the logits of the last token (the point ends where a chunk sampled), so a
    # request made of exactly these tokens needs no forward before its first draw
    has_logits: bool = False
    chain: int = field(repr=False, default=0)  # hash of (salt, full pages' tokens): the lookup key
    hits: int = 0  # requests that resumed from it (its value: ValueOrder), carried into the tiers below

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PrefixHit:
    point: StatePoint
    position: int  # tokens the request skips


class Resumable(Protocol):
    """What a lookup needs of a point, in any tier."""

    salt: str | None
    tokens: tuple[int, ...]
    has_logits: bool


def block_chain(salt: str | None, tokens: tuple[int, ...] | list[int], block_tokens: int, blocks: int) -> list[int]:
    """Chained hashes h_0 .. h_blocks: h_k covers the salt and the first k full blocks of tokens."""
    chain = [hash(("ds4serve-prefix", salt))]
    for k in range(blocks):
        chain.append(hash((chain[-1], tuple(tokens[k * block_tokens : (k + 1) * block_tokens]))))
    return chain


P = TypeVar("P", bound=Resumable)


def longest_point(by_chain: dict[int, list[P]], salt: str | None, tokens: Sequence[int], chain: list[int],
                  block_tokens: int) -> P | None:
    """The longest point of a chain index whose tokens start `tokens`: one probe per full page of them
    (`chain` is their block_chain), then an exact comparison, so a hash collision never serves wrong
    state. It leaves at least one token to compute, unless it covers all of them and kept the logits to
    draw the next one from."""
    for k in range(len(tokens) // block_tokens, -1, -1):  # points at k full blocks sit at [k, k + 1) blocks
        best = None
        for point in by_chain.get(chain[k], ()):
            p = len(point.tokens)
            limit = len(tokens) - (0 if point.has_logits else 1)
            if point.salt == salt and p <= limit and (best is None or p > len(best.tokens)) \
                    and tuple(tokens[:p]) == point.tokens:
                best = point
        if best is not None:
            return best
    return None


class ValueOrder(Generic[K]):
    """Eviction by value, GreedyDual: a key's priority is `clock + (1 + hits) * size` (size: its tokens),
    set when it enters and refreshed on each hit; the victim is the lowest priority, and the clock rises
    to each victim's, so what nobody uses ages out while long, often-hit prefixes stay. Equal priorities
    go least recently refreshed first. A heap with lazy deletion: refreshes push, stale entries are
    skipped when popped."""

    def __init__(self) -> None:
        self.clock = 0
        self._heap: list[tuple[int, int, K]] = []
        self._live: dict[K, tuple[int, int]] = {}  # key -> (priority, sequence) of its current heap entry
        self._sequence = 0

    def keys(self) -> set[K]:
        return set(self._live)

    def set(self, key: K, size: int, hits: int) -> None:
        self._sequence += 1
        entry = (self.clock + (1 + hits) * size, self._sequence)
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._live) + 64:  # too many stale entries: rebuild
            self._heap = [(*entry, k) for k, entry in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, key: K) -> None:
        self._live.pop(key, None)

    def pop(self, evictable: Callable[[K], bool] = lambda key: True) -> K | None:
        """Removes and returns the lowest-priority key that `evictable` allows (None: none does)."""
        skipped: list[tuple[int, int, K]] = []
        victim = None
        while self._heap:
            priority, sequence, key = heapq.heappop(self._heap)
            if self._live.get(key) != (priority, sequence):
                continue  # stale: refreshed or discarded since
            if evictable(key):
                victim = key
                del self._live[key]
                self.clock = priority
                break
            skipped.append((priority, sequence, key))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return victim


class PrefixCache:
    """The state points, their snapshot slots and their eviction order; page references go through
    the block manager's `cache_pages` / `uncache_pages`."""

    def __init__(self, snapshot_slots: list[int], block_tokens: int, blocks) -> None:
        self.block_tokens = block_tokens
        self.blocks = blocks  # BlockManager (pages are referenced by points as well as by requests)
        self.free_snapshots = list(reversed(snapshot_slots))
        self.points: dict[tuple[str | None, tuple[int, ...]], StatePoint] = {}
        self.by_chain: dict[int, list[StatePoint]] = {}
        self.order: ValueOrder[tuple[str | None, tuple[int, ...]]] = ValueOrder()
        # points whose state is still being computed (a chunk's point is taken as it is scheduled): lookups
        # do not find them until `confirm`; evictions take them last
        self.unconfirmed: set[tuple[str | None, tuple[int, ...]]] = set()
        # called with each victim before its snapshot slot and pages are freed (the scheduler spills it
        # into the host tier); dropping points for other reasons (clear, a replacement) does not call it
        self.on_evict: Callable[[StatePoint], None] = lambda point: None
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of which found in the cache

    @property
    def num_points(self) -> int:
        return len(self.points)

    def lookup(self, salt: str | None, tokens: list[int], count: bool = True,
               chain: list[int] | None = None) -> PrefixHit | None:
        """The longest point whose tokens start `tokens` (see `longest_point`); `chain`: their
        block_chain when the caller has it. A hit is only counted in the point's value by `touch`."""
        if chain is None:
            chain = block_chain(salt, tokens, self.block_tokens, len(tokens) // self.block_tokens)
        point = longest_point(self.by_chain, salt, tokens, chain, self.block_tokens)
        hit = PrefixHit(point, point.position) if point is not None else None
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += hit.position if hit else 0
        return hit

    def touch(self, point: StatePoint) -> None:
        """A request resumes from the point: its value rises."""
        point.hits += 1
        self.order.set((point.salt, point.tokens), point.position, point.hits)

    def insert(
        self, salt: str | None, tokens: tuple[int, ...], pages: tuple[int, ...], has_logits: bool = False,
        confirmed: bool = True,
    ) -> StatePoint | None:
        """A new point (None if an equal one exists: it is only refreshed, or if no snapshot slot can
        be had). The caller copies the request's slot into `point.snapshot` before it changes. An
        unconfirmed point (its chunk is still to run) holds its snapshot slot and pages, but lookups
        do not see it until `confirm`; `discard` drops it if its chunk failed."""
        if not tokens:
            return None
        key = (salt, tokens)
        if key in self.points and (self.points[key].has_logits or not has_logits):
            self.order.set(key, len(tokens), self.points[key].hits)
            return None
        hits = 0
        if key in self.points:  # the same tokens, now with logits: replace it
            hits = self.points[key].hits
            self._drop(key)
        if not self.free_snapshots and not self.evict_one():
            return None
        pages = pages[: -(-len(tokens) // self.block_tokens)]
        full = len(tokens) // self.block_tokens
        chain = block_chain(salt, tokens, self.block_tokens, full)[full]
        point = StatePoint(salt, tokens, self.free_snapshots.pop(), pages, has_logits, chain, hits)
        self.blocks.cache_pages(pages)
        self.points[key] = point
        if confirmed:
            self.by_chain.setdefault(chain, []).append(point)
        else:
            self.unconfirmed.add(key)
        self.order.set(key, len(tokens), hits)
        return point

    def confirm(self, point: StatePoint) -> None:
        """The point's chunk ran: lookups may find it, evictions may take it."""
        key = (point.salt, point.tokens)
        if key in self.unconfirmed and self.points.get(key) is point:
            self.unconfirmed.discard(key)
            self.by_chain.setdefault(point.chain, []).append(point)

    def discard(self, point: StatePoint) -> None:
        """The point's chunk failed: its snapshot would not hold its state."""
        key = (point.salt, point.tokens)
        if key in self.unconfirmed and self.points.get(key) is point:
            self._drop(key)

    def evict_one(self) -> bool:
        """Drops the point of lowest value (after `on_evict`); False when there is none."""
        # confirmed points first; an unconfirmed one is spilled too (its spill runs after its chunk)
        key = self.order.pop(lambda key: key not in self.unconfirmed) or self.order.pop()
        if key is None:
            return False
        self.on_evict(self.points[key])
        self._drop(key)
        return True

    def clear(self) -> None:
        """Drops every point, none spilled (a failed step: the snapshots may not hold what they should)."""
        for key in list(self.points):
            self._drop(key)

    def _drop(self, key: tuple[str | None, tuple[int, ...]]) -> None:
        point = self.points.pop(key)
        if key in self.unconfirmed:
            self.unconfirmed.discard(key)
        else:
            siblings = self.by_chain[point.chain]
            siblings.remove(point)
            if not siblings:
                del self.by_chain[point.chain]
        self.order.discard(key)
        self.blocks.uncache_pages(point.pages)
        self.free_snapshots.append(point.snapshot)

    def check_integrity(self, snapshot_slots: int) -> None:
        used = [p.snapshot for p in self.points.values()]
        assert len(set(used)) == len(used), "two points share a snapshot slot"
        assert len(used) + len(self.free_snapshots) == snapshot_slots, "snapshot slots leaked"
        indexed = sum(len(v) for v in self.by_chain.values())
        assert indexed == len(self.points) - len(self.unconfirmed), "the chain index does not match the points"
        assert self.unconfirmed <= set(self.points), "an unconfirmed point is not held"
        assert self.order.keys() == set(self.points), "the eviction order does not match the points"
