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
compared exactly, so a hash collision can never serve wrong state. Points are evicted least recently
used when snapshot slots or pages run out; a page is only ever freed when no request holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


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

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PrefixHit:
    point: StatePoint
    position: int  # tokens the request skips


def block_chain(salt: str | None, tokens: tuple[int, ...] | list[int], block_tokens: int, blocks: int) -> list[int]:
    """Chained hashes h_0 .. h_blocks: h_k covers the salt and the first k full blocks of tokens."""
    chain = [hash(("ds4serve-prefix", salt))]
    for k in range(blocks):
        chain.append(hash((chain[-1], tuple(tokens[k * block_tokens : (k + 1) * block_tokens]))))
    return chain


class PrefixCache:
    """The state points, their snapshot slots and their LRU order; page references go through the
    block manager's `cache_pages` / `uncache_pages`."""

    def __init__(self, snapshot_slots: list[int], block_tokens: int, blocks) -> None:
        self.block_tokens = block_tokens
        self.blocks = blocks  # BlockManager (pages are referenced by points as well as by requests)
        self.free_snapshots = list(reversed(snapshot_slots))
        self.points: OrderedDict[tuple[str | None, tuple[int, ...]], StatePoint] = OrderedDict()  # LRU first
        self.by_chain: dict[int, list[StatePoint]] = {}
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of which found in the cache

    @property
    def num_points(self) -> int:
        return len(self.points)

    def lookup(self, salt: str | None, tokens: list[int], count: bool = True) -> PrefixHit | None:
        """The longest point whose tokens start `tokens`. It leaves at least one token to compute,
        unless it covers all of them and kept the logits to draw the next one from."""
        full = len(tokens) // self.block_tokens
        chain = block_chain(salt, tokens, self.block_tokens, full)
        hit = None
        for k in range(full, -1, -1):  # points at k full blocks sit at positions [k, k + 1) blocks
            best = None
            for point in self.by_chain.get(chain[k], ()):
                p = point.position
                limit = len(tokens) - (0 if point.has_logits else 1)
                if point.salt == salt and p <= limit and tuple(tokens[:p]) == point.tokens:
                    if best is None or p > best.position:
                        best = point
            if best is not None:
                hit = PrefixHit(best, best.position)
                self.points.move_to_end((best.salt, best.tokens))
                break
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += hit.position if hit else 0
        return hit

    def insert(
        self, salt: str | None, tokens: tuple[int, ...], pages: tuple[int, ...], has_logits: bool = False
    ) -> StatePoint | None:
        """A new point (None if an equal one exists: it is only refreshed, or if no snapshot slot can
        be had). The caller copies the request's slot into `point.snapshot` before it changes."""
        if not tokens:
            return None
        key = (salt, tokens)
        if key in self.points and (self.points[key].has_logits or not has_logits):
            self.points.move_to_end(key)
            return None
        if key in self.points:  # the same tokens, now with logits: replace it
            self._drop(key)
        if not self.free_snapshots and not self.evict_one():
            return None
        pages = pages[: -(-len(tokens) // self.block_tokens)]
        full = len(tokens) // self.block_tokens
        chain = block_chain(salt, tokens, self.block_tokens, full)[full]
        point = StatePoint(salt, tokens, self.free_snapshots.pop(), pages, has_logits, chain)
        self.blocks.cache_pages(pages)
        self.points[key] = point
        self.by_chain.setdefault(chain, []).append(point)
        return point

    def evict_one(self) -> bool:
        """Drops the least recently used point; False when there is none."""
        if not self.points:
            return False
        self._drop(next(iter(self.points)))
        return True

    def _drop(self, key: tuple[str | None, tuple[int, ...]]) -> None:
        point = self.points.pop(key)
        siblings = self.by_chain[point.chain]
        siblings.remove(point)
        if not siblings:
            del self.by_chain[point.chain]
        self.blocks.uncache_pages(point.pages)
        self.free_snapshots.append(point.snapshot)

    def check_integrity(self, snapshot_slots: int) -> None:
        used = [p.snapshot for p in self.points.values()]
        assert len(set(used)) == len(used), "two points share a snapshot slot"
        assert len(used) + len(self.free_snapshots) == snapshot_slots, "snapshot slots leaked"
        indexed = sum(len(v) for v in self.by_chain.values())
        assert indexed == len(self.points), "the chain index does not match the points"
