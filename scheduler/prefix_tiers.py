"""The prefix cache's tiers below the GPU, host RAM and NVMe (docs/prefix-tiers.md): their books.

The scheduler decides every copy between tiers and the worker (worker/prefix_tiers.py) makes it, so
this module is ids and integers only: which host or disk slot and pages hold which state point, and
the `TierMove`s that fill them. A GPU point the prefix cache evicts is spilled into the host tier
instead of being lost, and written through to the disk tier; a request whose longest hit is on disk
has it fetched into the host tier first, then loaded like any host hit.

Each tier (`TierPool`) has slots (one point's fixed state and last logits each) and pages (one KV page
each), handed out from free lists. A full page is shared by every point of the tier whose tokens cover
it, reference counted, so the points one long conversation leaves store its pages once; it is indexed
by its parent page (the tier's page for the block before it) and its block's tokens, which says exactly
what it covers (salt and every token up to its end) with one dict probe per page, so two different
prefixes never share a page whatever their hashes. A point's partial last page is its own. Points are
found like the GPU's (`longest_point`: chain-hash probes, then an exact comparison) and evicted by value
(`ValueOrder`). A point some asynchronous move still reads or fills is pinned: never a victim.

Asynchronous moves (write, fetch) carry a ticket; until its TierDone the point a write fills is not
committed (not found, not in `DiskEntry`s) and the host point a fetch fills is not found either; the
pages either fills join the tier's shared pages only then (a failed move never leaves a page another
point relies on). Disk records carry seals: a fresh random 63-bit number per record per write, kept
with the record, which the worker writes into every 4 KiB page and a fetch checks, so a stale, torn or
corrupted record fails the fetch instead of serving wrong state.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from contract import TIER_MOVES, PrefixTierLimits, TierDone, TierMove
from scheduler.prefix_cache import StatePoint, ValueOrder, block_chain, longest_point

log = logging.getLogger("ds4serve.scheduler")

Key = tuple[str | None, tuple[int, ...]]  # a point: (salt, tokens)
PageKey = tuple[int, str | None, tuple[int, ...]]  # a shared page: (parent page or -1, salt, its block's tokens)


@dataclass(eq=False)
class TierPoint:
    """One state point in a host or disk tier."""

    salt: str | None
    tokens: tuple[int, ...]
    slot: int
    pages: tuple[int, ...]  # the tier's pages covering the tokens in order (the last one partial unless aligned)
    has_logits: bool
    hits: int = 0
    slot_seal: int = 0  # disk: the seal of this point's slot record (its pages' seals are the pool's)
    pins: int = 0  # moves that still read or fill it: never a victim while > 0
    published: bool = False  # found by lookups (a write's or fetch's target only once it finished)
    chain: int = field(repr=False, default=0)  # block_chain of its full pages: the lookup key

    @property
    def key(self) -> Key:
        return (self.salt, self.tokens)

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DiskEntry:
    """One committed disk point as the engine's catalog keeps it (engine/prefix_catalog.py), enough to
    rebuild the disk tier's books after a restart. No chain hashes: Python's hash of a string differs
    between processes, so `seed_disk` recomputes them."""

    salt: str | None
    tokens: tuple[int, ...]
    has_logits: bool
    slot: int  # its slot record
    pages: tuple[int, ...]  # its page records, in the order of its tokens
    seals: tuple[int, ...]  # the slot record's seal, then each page record's in order
    hits: int = 0


class TierPool:
    """One lower tier's slots, pages, points and eviction order."""

    def __init__(self, name: str, num_slots: int, num_pages: int, block_tokens: int, sealed: bool = False) -> None:
        self.name, self.num_slots, self.num_pages, self.block_tokens = name, num_slots, num_pages, block_tokens
        self.sealed = sealed  # disk: records carry seals
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.page_refs = [0] * num_pages  # points holding each page
        self.page_seals = [0] * num_pages  # disk: the seal of each page record's last write
        self.shared: dict[PageKey, int] = {}  # the full pages points share
        self.page_key: dict[int, PageKey] = {}
        self.points: dict[Key, TierPoint] = {}
        self.by_chain: dict[int, list[TierPoint]] = {}  # published points only
        self.order: ValueOrder[Key] = ValueOrder()  # published points only
        self.version = 0  # rises whenever the published points (or their hits) change

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def lookup(self, salt: str | None, tokens: Sequence[int], chain: list[int]) -> TierPoint | None:
        """The longest published point whose tokens start `tokens` (`chain`: their block_chain)."""
        return longest_point(self.by_chain, salt, tokens, chain, self.block_tokens)

    def touch(self, point: TierPoint) -> None:
        """A request resumes from the point: its value rises."""
        point.hits += 1
        self.order.set(point.key, point.position, point.hits)
        self.version += 1

    def reserve(self, salt: str | None, tokens: tuple[int, ...], has_logits: bool,
                hits: int) -> tuple[TierPoint, int] | None:
        """A new, unpublished point for `tokens`: it shares the full pages the tier holds for them and
        gets a slot and its other pages, evicting by value as needed. Returns it and the index of its
        first own page (the pages before it were shared, so no move fills them); None when no room can
        be made (the points left are pinned)."""
        shared = self._shared_prefix(salt, tokens)
        needed = self.pages_for(len(tokens)) - len(shared)
        if needed > self.num_pages - len(shared) or not self.num_slots:
            return None  # larger than the tier: evicting everything would not help
        for page in shared:  # claimed first: the evictions below cannot free them
            self.page_refs[page] += 1
        while not self.free_slots or len(self.free_pages) < needed:
            if self.evict_one() is None:
                self._release(shared)
                return None
        own = [self.free_pages.pop() for _ in range(needed)]
        for page in own:
            self.page_refs[page] = 1
            if self.sealed:
                self.page_seals[page] = secrets.randbits(63)
        full = len(tokens) // self.block_tokens
        point = TierPoint(salt, tokens, self.free_slots.pop(), tuple(shared + own), has_logits, hits,
                          secrets.randbits(63) if self.sealed else 0,
                          chain=block_chain(salt, tokens, self.block_tokens, full)[full])
        self.points[point.key] = point
        return point, len(shared)

    def publish(self, point: TierPoint) -> None:
        """The point's move finished: its full pages join the shared ones (one an equal page took meanwhile
        is dropped for it) and lookups find it."""
        pages, parent = list(point.pages), -1
        for k in range(point.position // self.block_tokens):
            key = self._page_key(parent, point.salt, point.tokens, k)
            page = self.shared.get(key)
            if page is None:
                self.shared[key], self.page_key[pages[k]] = pages[k], key
            elif page != pages[k]:
                self.page_refs[page] += 1
                self._release([pages[k]])
                pages[k] = page
            parent = pages[k]
        point.pages, point.published = tuple(pages), True
        self.by_chain.setdefault(point.chain, []).append(point)
        self.order.set(point.key, point.position, point.hits)
        self.version += 1

    def drop(self, point: TierPoint) -> None:
        """Frees the point's slot and the pages no other point holds."""
        del self.points[point.key]
        if point.published:
            siblings = self.by_chain[point.chain]
            siblings.remove(point)
            if not siblings:
                del self.by_chain[point.chain]
            self.order.discard(point.key)
            self.version += 1
        self._release(point.pages)
        self.free_slots.append(point.slot)

    def evict_one(self) -> TierPoint | None:
        """Drops the unpinned published point of lowest value; None when there is none."""
        key = self.order.pop(lambda key: not self.points[key].pins)
        if key is None:
            return None
        point = self.points[key]
        self.drop(point)
        return point

    def seals(self, point: TierPoint, first: int = 0) -> tuple[int, ...]:
        """The point's slot record's seal, then those of its page records from index `first` on."""
        return (point.slot_seal, *(self.page_seals[page] for page in point.pages[first:]))

    def entries(self) -> list[DiskEntry]:
        return [DiskEntry(p.salt, p.tokens, p.has_logits, p.slot, p.pages, self.seals(p), p.hits)
                for p in self.points.values() if p.published]

    def seed(self, entries: Sequence[DiskEntry]) -> None:
        """Rebuilds an empty pool from a catalog's entries: points, shared pages (two entries naming one
        page must agree on what it covers and on its seal), reference counts and free lists. ValueError
        for inconsistent entries; the pool is unusable then (the caller drops it)."""
        assert not self.points, "seed an empty pool"
        slots: set[int] = set()
        for entry in entries:
            tokens = tuple(entry.tokens)
            where = f"the {self.name} tier's entry for {len(tokens)} tokens at slot {entry.slot}"
            if not tokens or (entry.salt, tokens) in self.points:
                raise ValueError(f"{where}: no tokens, or the same point twice")
            if not 0 <= entry.slot < self.num_slots or entry.slot in slots:
                raise ValueError(f"{where}: slot outside [0, {self.num_slots}) or taken twice")
            if len(entry.pages) != self.pages_for(len(tokens)) or len(entry.seals) != len(entry.pages) + 1:
                raise ValueError(f"{where}: {len(entry.pages)} pages and {len(entry.seals)} seals for its tokens")
            if any(not 0 <= page < self.num_pages for page in entry.pages) or entry.hits < 0 \
                    or any(not 0 <= seal < 1 << 63 for seal in entry.seals):
                raise ValueError(f"{where}: a page outside [0, {self.num_pages}), a negative hit count or a bad seal")
            parent = -1
            for k, (page, seal) in enumerate(zip(entry.pages, entry.seals[1:])):
                if k < len(tokens) // self.block_tokens:
                    key = self._page_key(parent, entry.salt, tokens, k)
                    known = self.shared.get(key)
                    if known is None and self.page_refs[page]:
                        raise ValueError(f"{where}: page {page} also holds other tokens")
                    if known is not None and known != page:
                        raise ValueError(f"{where}: page {page} repeats page {known}")
                    if known is not None and self.page_seals[page] != seal:
                        raise ValueError(f"{where}: page {page} has two seals")
                    self.shared[key], self.page_key[page] = page, key
                    parent = page
                elif self.page_refs[page]:
                    raise ValueError(f"{where}: its partial last page {page} is not its own")
                self.page_refs[page] += 1
                self.page_seals[page] = seal
            slots.add(entry.slot)
            full = len(tokens) // self.block_tokens
            point = TierPoint(entry.salt, tokens, entry.slot, tuple(entry.pages), entry.has_logits, entry.hits,
                              entry.seals[0], chain=block_chain(entry.salt, tokens, self.block_tokens, full)[full])
            self.points[point.key] = point
            point.published = True
            self.by_chain.setdefault(point.chain, []).append(point)
            self.order.set(point.key, point.position, point.hits)
        self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in slots]
        self.free_pages = [p for p in range(self.num_pages - 1, -1, -1) if not self.page_refs[p]]
        self.version += 1

    def _page_key(self, parent: int, salt: str | None, tokens: tuple[int, ...], k: int) -> PageKey:
        return (parent, salt, tokens[k * self.block_tokens : (k + 1) * self.block_tokens])

    def _shared_prefix(self, salt: str | None, tokens: tuple[int, ...]) -> list[int]:
        """The tier's shared pages for the leading full pages of `tokens` (a page's key names its parent,
        so once one is missing, every later one is)."""
        pages, parent = [], -1
        for k in range(len(tokens) // self.block_tokens):
            page = self.shared.get(self._page_key(parent, salt, tokens, k))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def _release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.page_refs[page] -= 1
            if not self.page_refs[page]:
                key = self.page_key.pop(page, None)
                if key is not None:
                    del self.shared[key]
                self.page_seals[page] = 0
                self.free_pages.append(page)

    def check_integrity(self) -> None:
        """Slots and pages add up, reference counts match the points, the indexes match the published points."""
        slots = [p.slot for p in self.points.values()]
        assert len(set(slots)) == len(slots), f"{self.name}: two points share a slot"
        assert sorted(slots + self.free_slots) == list(range(self.num_slots)), f"{self.name}: slots leaked"
        refs = [0] * self.num_pages
        for key, point in self.points.items():
            assert key == point.key, f"{self.name}: a point filed under another key"
            assert len(point.pages) == self.pages_for(point.position), f"{self.name}: a point lacks pages"
            for page in point.pages:
                refs[page] += 1
        assert refs == self.page_refs, f"{self.name}: page reference counts do not match the points"
        free = sorted(self.free_pages)
        assert free == [p for p, count in enumerate(refs) if not count], f"{self.name}: free + used pages != total"
        assert len(self.page_key) == len(self.shared), f"{self.name}: the shared-page index is inconsistent"
        for key, page in self.shared.items():
            assert self.page_key[page] == key and refs[page], f"{self.name}: a shared page is free or misfiled"
        published = [p for p in self.points.values() if p.published]
        for point in published:  # the keys' parent chains (their tokens are the points' by construction)
            parent, full = -1, point.position // self.block_tokens
            for page in point.pages[:full]:
                key = self.page_key.get(page)
                assert key is not None and key[:2] == (parent, point.salt), \
                    f"{self.name}: a published point's full page is not the tier's shared one"
                parent = page
            if full < len(point.pages):
                partial = point.pages[full]
                assert partial not in self.page_key and refs[partial] == 1, f"{self.name}: a partial page is shared"
        assert all(p.pins for p in self.points.values() if not p.published), \
            f"{self.name}: an unpublished point no move fills"
        assert sum(map(len, self.by_chain.values())) == len(published) \
            and all(p in self.by_chain.get(p.chain, ()) for p in published), f"{self.name}: the chain index is off"
        assert self.order.keys() == {p.key for p in published}, f"{self.name}: the eviction order is off"


@dataclass(eq=False)
class Ticket:
    """An asynchronous move in flight: the host and disk points it pins."""

    kind: str  # "write" (host -> disk) or "fetch" (disk -> host)
    host: TierPoint
    disk: TierPoint
    # a fetch outstanding when a step failed: the worker's reader may still fill its host rows, so they
    # stay reserved until its TierDone, whatever it says, and are then dropped
    orphaned: bool = False


class PrefixTiers:
    """The host tier, the disk tier (when on), and the moves between them and the GPU: spills and
    writes come from GPU evictions, fetches from requests whose longest hit is on disk, loads from
    admissions (the scheduler builds those). Moves collect here until the next plan takes them."""

    def __init__(self, limits: PrefixTierLimits, block_tokens: int) -> None:
        self.limits, self.block_tokens = limits, block_tokens
        self.host = TierPool("host", limits.host_slots, limits.host_pages, block_tokens)
        self.disk = self._disk_pool() if limits.disk else None
        self.tickets: dict[int, Ticket] = {}  # asynchronous moves whose TierDone has not come
        self.fetch_failures = 0
        self._moves: list[TierMove] = []  # spills, writes and fetches for the next plan
        # host points pinned until the next plan is built: a spill's target (no second spill in the same
        # plan may reuse its rows: the worker copies a plan's spills as one batch) and a load's source
        self._held: list[TierPoint] = []
        self._fetches: dict[Key, int] = {}  # disk point -> the ticket of its fetch in flight
        self._next_ticket = 1  # never reused, so a TierDone of a forgotten move matches nothing

    @property
    def busy(self) -> bool:
        """Moves to send, or asynchronous ones still out."""
        return bool(self._moves or self.tickets)

    @property
    def pinning(self) -> bool:
        """Moves or the next plan's holds pin points: a tier with no room now may have some once they are done."""
        return bool(self._moves or self.tickets or self._held)

    def lookup(self, salt: str | None, tokens: Sequence[int], chain: list[int]) -> tuple[TierPoint | None, TierPoint | None]:
        """The longest host point and the longest committed disk point `tokens` start with."""
        disk = self.disk.lookup(salt, tokens, chain) if self.disk is not None else None
        return self.host.lookup(salt, tokens, chain), disk

    def spill(self, point: StatePoint, source: int) -> None:
        """A GPU victim into the host tier, from model-cache slot `source`: only the full pages the host
        lacks are copied, and the partial last page; written through to disk. Lost when the host tier
        cannot make room, or when it holds the point already."""
        key = (point.salt, point.tokens)
        existing = self.host.points.get(key)
        if existing is not None:
            if existing.pins or existing.has_logits or not point.has_logits:
                return
            self.host.drop(existing)  # the same tokens, now with logits
        reserved = self.host.reserve(point.salt, point.tokens, point.has_logits, point.hits)
        if reserved is None:
            log.debug("prefix host tier full (every point pinned): a %d-token point is lost", point.position)
            return
        target, first = reserved
        self.host.publish(target)  # a spill runs before anything in its plan reads the host tier
        self.hold(target)
        self._moves.append(TierMove("spill", (source, target.slot), tuple(zip(point.pages[first:], target.pages[first:]))))
        self._write(target)

    def flush(self, point: StatePoint, source: int) -> bool:
        """A GPU point on its way to the disk tier as the engine stops (Scheduler.flush): spilled into the
        host tier from model-cache slot `source` and written through, or only written when the host holds
        it already. True once the disk holds it or its write is out; False when a tier has no room for it
        now (every point pinned, or the point larger than the tier)."""
        disk, key = self.disk, (point.salt, point.tokens)
        assert disk is not None

        def on_disk() -> bool:
            held = disk.points.get(key)
            return held is not None and (held.has_logits or not point.has_logits)

        if not on_disk():
            host = self.host.points.get(key)
            if host is not None and host.published and (host.has_logits or not point.has_logits):
                self._write(host)
            else:
                self.spill(point, source)
        return on_disk()

    def _write(self, source: TierPoint) -> None:
        """Write-through of a host point to disk: pages the disk lacks, fresh seals, a ticket."""
        disk = self.disk
        if disk is None:
            return
        existing = disk.points.get(source.key)
        if existing is not None:
            if existing.pins or existing.has_logits or not source.has_logits:
                return
            disk.drop(existing)
        reserved = disk.reserve(source.salt, source.tokens, source.has_logits, source.hits)
        if reserved is None:
            return
        target, first = reserved
        ticket = self._ticket("write", source, target)
        self._moves.append(TierMove("write", (source.slot, target.slot),
                                    tuple(zip(source.pages[first:], target.pages[first:])), disk.seals(target, first), ticket))

    def fetch(self, point: TierPoint) -> int | None:
        """A committed disk point into the host tier: the ticket to wait for (the one in flight, if the
        point is being fetched already); None when the host tier cannot make room."""
        assert self.disk is not None and point.published
        ticket = self._fetches.get(point.key)
        if ticket is not None:
            return ticket
        existing = self.host.points.get(point.key)
        if existing is not None:  # the same tokens without logits: the fetched point replaces it
            if existing.pins:
                return None
            self.host.drop(existing)
        reserved = self.host.reserve(point.salt, point.tokens, point.has_logits, point.hits)
        if reserved is None:
            return None
        target, first = reserved
        ticket = self._ticket("fetch", target, point)
        self._fetches[point.key] = ticket
        self._moves.append(TierMove("fetch", (point.slot, target.slot),
                                    tuple(zip(point.pages[first:], target.pages[first:])), self.disk.seals(point, first), ticket))
        return ticket

    def hold(self, point: TierPoint) -> None:
        """Pins a host point until the next plan is built (a load's source, held before the request's
        pages are taken: evictions that spill may not reuse its rows before the load reads them)."""
        point.pins += 1
        self._held.append(point)

    def load(self, point: TierPoint, slot: int, pages: Sequence[int]) -> TierMove:
        """Host -> GPU for an admitted request (its point held): the point's slot into `slot`, its pages
        into `pages` (the request's first ones); the point's value rises."""
        self.host.touch(point)
        return TierMove("load", (point.slot, slot), tuple(zip(point.pages, pages, strict=True)))

    def take_moves(self, loads: Sequence[TierMove]) -> tuple[TierMove, ...]:
        """The plan's tier moves in the order they run (spill, write, fetch, then `loads`); the points
        held for this plan are released."""
        moves = sorted(self._moves, key=lambda move: TIER_MOVES.index(move.kind))
        self._moves = []
        for point in self._held:
            point.pins -= 1
        self._held = []
        return (*moves, *loads)

    def done(self, done: TierDone) -> Ticket | None:
        """Applies a finished asynchronous move; None for a ticket not (or no longer) outstanding."""
        ticket = self.tickets.pop(done.ticket, None)
        if ticket is None:
            return None
        assert self.disk is not None
        ticket.host.pins -= 1
        ticket.disk.pins -= 1
        if ticket.orphaned:
            self.host.drop(ticket.host)
            return ticket
        if ticket.kind == "write":
            if done.error is None:
                self.disk.publish(ticket.disk)
            else:
                log.warning("prefix disk tier: a write failed, its point is dropped: %s", done.error)
                self.disk.drop(ticket.disk)
            return ticket
        del self._fetches[ticket.disk.key]
        if done.error is None:
            self.disk.touch(ticket.disk)
            self.host.publish(ticket.host)
            self.hold(ticket.host)  # not a victim of this step's spills: its requests are admitted next
        else:
            log.warning("prefix disk tier: a fetch failed, its point and the points sharing its pages are dropped: %s",
                        done.error)
            self.fetch_failures += 1
            self._drop_bad(ticket.disk, done.bad_pages)
            self.host.drop(ticket.host)
        return ticket

    def _drop_bad(self, failed: TierPoint, bad_pages: tuple[int, ...] | None) -> None:
        """A fetch of `failed` did not verify: it goes, and so does every disk point holding one of the
        page records that failed (all of its pages when the worker could not say which): else a
        recomputed prefix, written through, would link a bad record again (only the pages the disk lacks
        are written). A bad slot record is the point's own. Pinned points (their own move in flight)
        find out by themselves."""
        assert self.disk is not None
        bad = set(failed.pages if bad_pages is None else bad_pages)
        self.disk.drop(failed)
        for point in [p for p in self.disk.points.values() if not p.pins and bad & set(p.pages)]:
            self.disk.drop(point)

    def drop_host(self) -> None:
        """A failed step: every host point goes and outstanding writes are forgotten (their points were
        never committed, so they go too: a late write only fills records nothing references); committed
        disk points stay, since a fetch verifies them. An outstanding fetch is orphaned, not forgotten:
        the worker may still write its host rows, so they stay reserved until its TierDone."""
        for number, ticket in list(self.tickets.items()):
            assert self.disk is not None
            if ticket.kind == "write":
                self.disk.drop(ticket.disk)
                del self.tickets[number]
            else:
                ticket.orphaned = True
        self._fetches.clear()
        self._moves.clear()
        self._held.clear()
        orphans = {id(t.host) for t in self.tickets.values()}
        for point in list(self.host.points.values()):
            if id(point) not in orphans:
                self.host.drop(point)

    def disk_entries(self) -> list[DiskEntry]:
        return self.disk.entries() if self.disk is not None else []

    def seed_disk(self, entries: Sequence[DiskEntry]) -> None:
        """The disk tier from the catalog, before any request (ValueError: inconsistent, nothing changed)."""
        if not entries:
            return
        if self.disk is None:
            raise ValueError("the prefix cache's disk tier is off")
        if self.disk.points:
            raise ValueError("the disk tier is seeded once, before any request")
        pool = self._disk_pool()
        pool.seed(entries)
        pool.version += self.disk.version  # the version never goes back
        self.disk = pool

    def _disk_pool(self) -> TierPool:
        return TierPool("disk", self.limits.disk_slots, self.limits.disk_pages, self.block_tokens, sealed=True)

    def _ticket(self, kind: str, host: TierPoint, disk: TierPoint) -> int:
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self.tickets[ticket] = Ticket(kind, host, disk)
        host.pins += 1
        disk.pins += 1
        return ticket

    def check_integrity(self) -> None:
        """Every tier adds up, and pins are exactly the outstanding tickets' and this plan's holds."""
        pools = [self.host] + ([self.disk] if self.disk is not None else [])
        for pool in pools:
            pool.check_integrity()
        pins: dict[int, int] = {}
        for point in [p for t in self.tickets.values() for p in (t.host, t.disk)] + self._held:
            pins[id(point)] = pins.get(id(point), 0) + 1
        for pool in pools:
            for point in pool.points.values():
                assert point.pins == pins.pop(id(point), 0), f"{pool.name}: a point's pins do not match its moves"
        assert not pins, "a move pins a point its tier no longer has"
        for ticket in self.tickets.values():
            filling = ticket.disk if ticket.kind == "write" else ticket.host
            reading = ticket.host if ticket.kind == "write" else ticket.disk
            assert not filling.published and reading.published, f"a {ticket.kind} fills a published point"
        fetches = {t.disk.key: n for n, t in self.tickets.items() if t.kind == "fetch" and not t.orphaned}
        assert self._fetches == fetches, "the fetches in flight do not match the tickets"
