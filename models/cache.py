"""Per-sequence model state in caller-owned buffers.

Two kinds of state (ARCHITECTURE.md, "Caches and state"):
- fixed per cache slot: the sliding-window ring (the last `sliding_window` K=V entries), each
  compressor's ring of raw projections for groups that are not closed yet, and V4.1's Engram look-back;
- paged, growing with length: compressed KV entries and indexer keys, one per `compress_rate` tokens.
  A page covers the same `block_tokens` token span in every paged layer (block_tokens / rate entries
  of that layer), so one block table per sequence serves all layers. The engine's block manager
  hands out pages; a batch chunk carries its sequence's table (`SequenceChunk.pages`).
The buffers are allocated once; a forward step only writes rows into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.config import CSA, ModelConfig
from models.host_tier import HostTierSpec, HotRing, TieredPages
from models.packed_pages import Codec, FP4Codec, FP8Codec, PackedPages
from models.transfer import on_device

KV_CACHE_DTYPES = ("auto", "fp4", "fp8")


@dataclass
class PoolerCache:
    """State of one window pooler (a compressor or an indexer's key compressor)."""

    raw_kv: torch.Tensor  # [slots, ring, width] projections of tokens of still-needed windows
    raw_gate: torch.Tensor  # [slots, ring, width]
    entries: torch.Tensor | PackedPages  # [pages, block_tokens // rate, head_dim] paged pooled entries

    @property
    def ring(self) -> int:
        return self.raw_kv.shape[1]


@dataclass
class SharedStore:
    """V4.1 kv-source state: the compressed entries later layers share, their index keys, and the raw
    projections of each slot's still-open group (ratio r > 1 pools r tokens per entry)."""

    # [slots, rows, head_dim] float32, token p at row p % rows (rows: r + draft tokens; empty for r = 1)
    raw_kv: torch.Tensor
    raw_gate: torch.Tensor  # [slots, rows, head_dim] float32
    entries: torch.Tensor | PackedPages | TieredPages  # [pages, block_tokens // r, head_dim]; stored fp4-rounded with RoPE
    index_keys: torch.Tensor | PackedPages | None  # [pages, block_tokens // r, index_head_dim] if the source owns keys

    def paged(self) -> list[torch.Tensor]:
        """The page-first tensors (a packed store's code and scale bytes)."""
        return [t for store in (self.entries, self.index_keys) if store is not None for t in _page_tensors(store)]


@dataclass
class LayerCache:
    window: torch.Tensor  # [slots, rows, head_dim], position p at row p % rows (rows: sliding_window + drafts)
    compressor: PoolerCache | None
    indexer: PoolerCache | None
    shared: SharedStore | None = None  # V4.1 kv sources only


# A paged store is a [pages, per_page, dim] tensor, PackedPages (packed FP4 or FP8) or TieredPages (packed
# FP4 in the host tier with a GPU hot ring), the last two with the same calls: the helpers below
# address entries of a sequence through its block table whichever it is.
PagedStore = torch.Tensor | PackedPages | TieredPages


def _page_tensors(store: PagedStore) -> list[torch.Tensor]:
    """A store's page-first tensors: itself, or a packed store's code and scale bytes."""
    return [store] if isinstance(store, torch.Tensor) else store.tensors()


def paged_pages(store: PagedStore, tables: torch.Tensor) -> torch.Tensor:
    """Whole pages: tables [...] -> [..., per_page, dim]."""
    return store[tables] if isinstance(store, torch.Tensor) else store.pages(tables)


def _at(store: PagedStore, page: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return store[page, index] if isinstance(store, torch.Tensor) else store.at(page, index)


def _put(store: PagedStore, page: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
         where: torch.Tensor | None = None) -> None:
    if not isinstance(store, torch.Tensor):
        store.put(page, index, values, where)
        return
    values = values.to(store.dtype)
    if where is not None:
        values = torch.where(where[:, None], values, store[page, index])
    store[page, index] = values


def paged_read(store: PagedStore, pages: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` entries of a sequence, [count, dim], from its block table."""
    per_page = store.shape[1]
    return paged_pages(store, pages[: -(-count // per_page)]).flatten(0, 1)[:count]


def paged_write(store: PagedStore, pages: torch.Tensor, first: int, values: torch.Tensor) -> None:
    """Writes entries first .. first + len(values) - 1 of a sequence."""
    index = torch.arange(first, first + values.shape[0], device=pages.device)
    per_page = store.shape[1]
    _put(store, pages[index // per_page], index % per_page, values)


def paged_gather(store: PagedStore, pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Entries at sequence-relative ids (any shape, all >= 0) -> [*ids.shape, dim]."""
    per_page = store.shape[1]
    return _at(store, pages[ids // per_page], ids % per_page)


def paged_gather_rows(store: PagedStore, tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per sequence b, the entries at sequence-relative ids[b] through block table tables[b]:
    tables [B, P], ids [B, k] -> [B, k, dim]."""
    per_page = store.shape[1]
    return _at(store, tables.gather(1, ids // per_page), ids % per_page)


def paged_write_rows(
    store: PagedStore, tables: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, where: torch.Tensor | None = None
) -> None:
    """Per sequence b, entry ids[b] := values[b] through block table tables[b] (tables [B, P], ids [B],
    values [B, dim]); with `where` [B] bool, only where it holds (elsewhere the entry keeps its value).
    Shapes depend only on B, so a decode graph can write this way every step."""
    per_page = store.shape[1]
    page = tables.gather(1, (ids // per_page)[:, None]).squeeze(1)
    _put(store, page, ids % per_page, values, where)


def stored_kv_cache_dtype(config: ModelConfig, kv_cache_dtype: str) -> str:
    """What the paged stores hold for `memory.kv_cache_dtype`: fp8 on V4.1 (with its simulated
    quantization, as served) is the fp4 packing, since V4.1's compressed entries and index keys are
    FP4 values already: fp4 keeps a 512-wide entry exactly in 288 bytes, where fp8 would take 604 and
    round it (an E2M1 value times its e4m3 scale per 16 has up to 6 significant bits, e4m3 keeps 4, and
    a scale per 64 spans four scales per 16; on random FP4-rounded entries 63% of the values moved, by
    up to 5.7%). On V4, and on V4.1 without its rounding (a reference mode), fp8 is e4m3
    (kernels/kv_pack.py)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose from {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "fp8" and config.is_v41 and config.simulate_quantization:
        return "fp4"
    return kv_cache_dtype


def _codecs(config: ModelConfig, kind: str) -> tuple[Codec, Codec] | None:
    """(compressed entries' codec, index keys' codec) for a stored kv_cache_dtype; None: plain tensors.
    fp8 keeps an entry's RoPE channels (its last rope_head_dim) in bf16, as vLLM's fp8_ds_mla does; index
    keys are e4m3 throughout (they only rank entries for the top-k)."""
    if kind == "fp4":
        return FP4Codec("e4m3"), FP4Codec("ue8m0")
    if kind == "fp8":
        return FP8Codec(tail=config.rope_head_dim), FP8Codec()
    return None


def page_granularity(config: ModelConfig) -> int:
    """block_tokens must be a multiple of this: every paged layer's rate divides a page evenly."""
    return math.lcm(1, *(r for r in config.compress_rates if r > 0))


@dataclass
class ModelCache:
    layers: list[LayerCache]
    num_slots: int
    max_len: int  # longest sequence a slot's default pages hold (when pages are per slot)
    num_pages: int
    block_tokens: int
    # V4.1 Engram: the last max_ngram - 1 compressed token ids per slot, oldest first, -1 = none;
    # a chunk at position 0 starts from all -1, whatever the slot held before.
    engram_context: torch.Tensor | None = None
    slot_pages: int = 0  # > 0: slot s owns pages [s * slot_pages, (s + 1) * slot_pages) by default
    hot: HotRing | None = None  # with a host tier: which pages the GPU ring holds

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_pages: int | None = None,
        block_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        host_tier: HostTierSpec | None = None,
        draft_tokens: int = 0,
    ) -> "ModelCache":
        """Without `num_pages`, every slot gets its own pages for `max_len` tokens (tests, tools);
        the engine passes the page count its memory plan affords and block tables per chunk.
        `kv_cache_dtype` "fp4": V4.1's compressed entries and index keys as packed FP4 pages
        (models/packed_pages.py), lossless because the model rounds them to FP4 itself (refused for V4.1
        without its simulated quantization, a reference mode); for V4, whose cache is not rounded, an
        opt-in that rounds its compressed entries and index keys the same way (lossy: see
        tests/test_packed_kv.py for the measured error). "fp8": e4m3 with a float32 scale per 64
        channels, an entry's RoPE channels in bf16 (V4; lossy, as vLLM's fp8); on V4.1 the fp4 packing
        (`stored_kv_cache_dtype`). `host_tier`: V4.1's packed compressed entries live in host memory
        with a GPU ring of each sequence's recent pages (models/host_tier.py).

        `draft_tokens`: the most draft tokens a step verifies (speculative decoding). The per-slot rings
        (the window, the poolers' open groups) get that many rows more than they need, so that the
        rows a rejected draft wrote are never rows a position before it still needs: rolling a slot
        back is only resuming it at the accepted position, with nothing to restore (a rejected draft's
        paged entry is rewritten when the real token closes its window, before any query can see
        it). V4.1's shared stores' open groups get the spare rows too; its Engram look-back is the one
        state a verify step must put back (EngramMemory.rewind, which the runner calls)."""
        if draft_tokens < 0:
            raise ValueError(f"draft_tokens {draft_tokens}: a count of tokens, >= 0")
        kv_cache_dtype = stored_kv_cache_dtype(config, kv_cache_dtype)
        if kv_cache_dtype == "fp4" and config.is_v41 and not config.simulate_quantization:
            raise ValueError("kv_cache_dtype fp4 is lossless only when V4.1's simulated quantization is on")
        if host_tier is not None and (kv_cache_dtype != "fp4" or not config.is_v41):
            raise ValueError("the KV host tier (offload.kv host_packed) holds V4.1's packed entries: it needs a V4.1"
                             " model and memory.kv_cache_dtype fp4")
        unit = page_granularity(config)
        block_tokens = block_tokens or unit
        if block_tokens % unit:
            raise ValueError(f"block_tokens {block_tokens} must be a multiple of {unit} (the compress rates' lcm)")
        slot_pages = 0
        if num_pages is None:
            slot_pages = -(-max_len // block_tokens)
            num_pages = num_slots * slot_pages
        hot = None
        if host_tier is not None:
            hot_pages = -(-host_tier.hot_tokens // block_tokens)
            hot = HotRing(num_pages, host_tier.sequences * hot_pages, hot_pages, block_tokens, device)
        codecs = _codecs(config, kv_cache_dtype)
        if config.is_v41:
            layers = cls._v41_layers(config, num_slots, num_pages, block_tokens, dtype, device, codecs, hot,
                                     draft_tokens)
        else:
            layers = cls._v4_layers(config, num_slots, num_pages, block_tokens, dtype, device, codecs, draft_tokens)
        context = None
        if config.engram is not None:
            context = torch.full((num_slots, config.engram.context_len), -1, dtype=torch.long, device=device)
        return cls(layers, num_slots, max_len, num_pages, block_tokens, context, slot_pages, hot)

    @staticmethod
    def _v4_layers(config, num_slots, num_pages, block_tokens, dtype, device,
                   codecs: tuple[Codec, Codec] | None, draft_tokens: int = 0) -> list[LayerCache]:
        entry_codec, key_codec = codecs or (None, None)

        def pooler(rate: int, overlap: bool, head_dim: int, codec: Codec | None) -> PoolerCache:
            width = (2 if overlap else 1) * head_dim
            ring = (2 if overlap else 1) * rate + draft_tokens
            per_page = block_tokens // rate
            if codec is not None:
                entries = PackedPages.allocate(num_pages, per_page, head_dim, codec, dtype, device)
            else:
                entries = torch.zeros(num_pages, per_page, head_dim, dtype=dtype, device=device)
            return PoolerCache(
                raw_kv=torch.zeros(num_slots, ring, width, dtype=dtype, device=device),
                raw_gate=torch.zeros(num_slots, ring, width, dtype=dtype, device=device),
                entries=entries,
            )

        layers = []
        for layer, kind in enumerate(config.layer_types):
            rate = config.compress_rates[layer]
            window = torch.zeros(num_slots, config.sliding_window + draft_tokens, config.head_dim, dtype=dtype,
                                 device=device)
            compressor = pooler(rate, kind == CSA, config.head_dim, entry_codec) if rate else None
            indexer = pooler(rate, True, config.index_head_dim, key_codec) if kind == CSA else None
            layers.append(LayerCache(window=window, compressor=compressor, indexer=indexer))
        return layers

    @staticmethod
    def _v41_layers(config, num_slots, num_pages, block_tokens, dtype, device, codecs: tuple[Codec, Codec] | None,
                    hot: HotRing | None, draft_tokens: int = 0) -> list[LayerCache]:
        """Every layer keeps a window; only kv sources keep compressed state, which later layers read
        (their entries in the host tier when there is one; index keys stay on the device)."""
        shared = config.shared_compression

        entry_codec, key_codec = codecs or (None, None)

        def paged(per_page: int, dim: int, codec: Codec | None) -> torch.Tensor | PackedPages:
            if codec is not None:
                return PackedPages.allocate(num_pages, per_page, dim, codec, dtype, device)
            return torch.zeros(num_pages, per_page, dim, dtype=dtype, device=device)

        layers = []
        for layer in range(config.num_layers):
            window = torch.zeros(num_slots, config.sliding_window + draft_tokens, config.head_dim, dtype=dtype,
                                 device=device)
            store = None
            if layer in shared.kv_sources:
                rate = config.compress_rates[layer]
                ring, per_page = (rate + draft_tokens if rate > 1 else 0), block_tokens // rate
                store = SharedStore(
                    raw_kv=torch.zeros(num_slots, ring, config.head_dim, dtype=torch.float32, device=device),
                    raw_gate=torch.zeros(num_slots, ring, config.head_dim, dtype=torch.float32, device=device),
                    entries=(paged(per_page, config.head_dim, entry_codec) if hot is None else
                             TieredPages.allocate(hot, num_pages, per_page, config.head_dim, "e4m3", dtype, device)),
                    index_keys=paged(per_page, config.index_head_dim, key_codec) if layer in shared.index_sources else None,
                )
            layers.append(LayerCache(window=window, compressor=None, indexer=None, shared=store))
        return layers

    def default_pages(self, slot: int) -> torch.Tensor:
        if not self.slot_pages:
            raise ValueError("this cache's pages are handed out by a block manager: pass the chunk's block table")
        return torch.arange(slot * self.slot_pages, (slot + 1) * self.slot_pages)

    def capacity(self, pages: torch.Tensor) -> int:
        return pages.shape[0] * self.block_tokens

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The per-slot state, slot first: what a prefix-cache snapshot copies."""
        out: list[torch.Tensor] = []
        for layer in self.layers:
            out.append(layer.window)
            for pooler in (layer.compressor, layer.indexer):
                if pooler is not None:
                    out += [pooler.raw_kv, pooler.raw_gate]
            if layer.shared is not None:
                out += [layer.shared.raw_kv, layer.shared.raw_gate]
        if self.engram_context is not None:
            out.append(self.engram_context)
        return [t for t in out if t.shape[1]]  # a ratio-1 source keeps no open group

    def copy_slots(self, sources: list[int], targets: list[int]) -> None:
        """Fixed state of slot sources[i] -> targets[i] (distinct targets)."""
        _copy_rows(self.fixed_tensors(), sources, targets)

    def copy_pages(self, sources: list[int], targets: list[int]) -> None:
        """Paged entries of page sources[i] -> targets[i] in every paged layer (host tier included)."""
        _copy_rows(self.paged_tensors(), sources, targets)
        if self.hot is not None:
            self.hot.refresh(targets)

    def hold_hot(self, steps: list[tuple[tuple[int, ...], int]]) -> None:
        """Before a step: (block table, end position) of each sequence in it; with a host tier, the
        GPU ring then holds each one's recent pages (a no-op without one)."""
        if self.hot is not None:
            self.hot.hold([page for pages, end in steps for page in self.hot.wanted(pages, end)])

    def ring_tensors(self) -> list[torch.Tensor]:
        """The host tier's GPU ring: fixed, not per page."""
        if self.hot is None:
            return []
        return [self.hot.location] + [t for store in self.hot.stores for t in store.ring_tensors()]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the cache: the per-slot state, then the pages."""
        return self.fixed_tensors() + self.paged_tensors()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() + self.ring_tensors())

    def paged_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for layer in self.layers:
            for pooler in (layer.compressor, layer.indexer):
                if pooler is not None:
                    out += _page_tensors(pooler.entries)
            if layer.shared is not None:
                out += layer.shared.paged()
        return out

    def page_bytes(self) -> int:
        """Bytes one page adds across every paged layer, both tiers (what the memory plan divides by)."""
        return sum(t[0].numel() * t.element_size() for t in self.paged_tensors())

    def host_tier_page_bytes(self) -> int:
        """The part of page_bytes() that lives in the host tier (0 without one)."""
        if self.hot is None:
            return 0
        return sum(t[0].numel() * t.element_size() for store in self.hot.stores for t in store.tensors())

    def slot_bytes(self) -> int:
        """Bytes of the fixed state: per slot (windows, open groups, look-back), all slots, and the host
        tier's GPU ring."""
        return self.nbytes() - self.num_pages * self.page_bytes()


def _copy_rows(tensors: list[torch.Tensor], sources: list[int], targets: list[int]) -> None:
    """tensor[targets[i]] = tensor[sources[i]] for each tensor: one indexed copy per tensor."""
    if not sources:
        return
    src = on_device(sources, torch.long, tensors[0].device)
    dst = on_device(targets, torch.long, tensors[0].device)
    for tensor in tensors:
        tensor[dst] = tensor[src]
