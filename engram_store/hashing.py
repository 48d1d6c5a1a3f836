"""Engram n-gram hashing (DeepSeek-V4.1): which table rows each token looks up.

Row ids depend only on token ids, so they can be computed as soon as tokens are known (the engram
store prefetches with them). The pieces, in order:
1. Tokenizer compression: token ids whose text normalises alike share one compressed id.
2. Layout: per Engram layer, per n-gram order n = 2..N, per head, a distinct prime table size;
   columns (n-2)*heads + head are laid out back to back in one table per layer.
3. Multipliers: per layer, N odd int64s from numpy's default_rng(10007 * layer_id), bounded so that
   token * multiplier never overflows int64.
4. Hash: mix = t0*m0, then for k = 1..N-1, mix ^= tk*mk and every head of order k+1 takes
   mix % prime. tk is the compressed id k positions back; the look-back is blocked (pad id) once it
   passes the sequence start or a dead position, and stays blocked for larger k.
Decode carries the last N-1 compressed ids of each sequence, so hashing one token at a time equals
hashing the whole sequence.
Here rather than in models/: the store builder, the table converter and `plan` need the layout, and
engram_store/ imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from tokenizers import Regex, normalizers

from kernels import engram_hash

DEAD = -1  # a look-back slot that is blocked: before the sequence start or at a dead position
_SENTINEL = "\ue000"


@lru_cache(maxsize=1)
def _normalizers() -> tuple[normalizers.Normalizer, normalizers.Normalizer]:
    """The reference's steps run as the `tokenizers` (Rust) normalizers, whose notions of accents and
    whitespace differ from Python's str methods at the edges (e.g. Python strips \\x1c-\\x1f)."""
    folding = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ])
    return folding, normalizers.Strip()


def _normalized_key(text: str) -> str:
    folding, strip = _normalizers()
    key = folding.normalize_str(text)
    key = _SENTINEL if key == " " else key  # a lone space token must not vanish
    key = strip.normalize_str(key).replace(_SENTINEL, " ")
    return key or text


def build_compressed_token_map(tokenizer) -> list[int]:
    """lookup[raw id] -> compressed id, numbered in order of first appearance.

    `tokenizer` is a `tokenizers.Tokenizer`; each id is decoded alone, special tokens included.
    Partial UTF-8 pieces (text with U+FFFD) key on their raw token string instead.
    """
    lookup, ids_by_key = [], {}
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else _normalized_key(text)
        lookup.append(ids_by_key.setdefault(key, len(ids_by_key)))
    return lookup


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    factor = 3
    while factor * factor <= n:
        if n % factor == 0:
            return False
        factor += 2
    return True


@dataclass(frozen=True)
class EngramLayout:
    """primes[layer index][n - 2][head]; offsets[layer index][column]; rows per layer table."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]

    @property
    def n_columns(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def build(cls, layer_ids: list[int], max_ngram: int, n_heads: int, prime_search_start: int) -> "EngramLayout":
        used: set[int] = set()
        primes, offsets, sizes = [], [], []
        for _ in layer_ids:
            layer_primes = []
            for _order in range(2, max_ngram + 1):
                candidate, heads = prime_search_start - 1, []
                for _head in range(n_heads):
                    candidate += 1
                    while not _is_prime(candidate) or candidate in used:
                        candidate += 1
                    used.add(candidate)
                    heads.append(candidate)
                layer_primes.append(tuple(heads))
            flat = [p for order in layer_primes for p in order]
            offsets.append(tuple(int(x) for x in np.concatenate([[0], np.cumsum(flat)[:-1]])))
            sizes.append(sum(flat))
            primes.append(tuple(layer_primes))
        return cls(tuple(layer_ids), max_ngram, n_heads, tuple(primes), tuple(offsets), tuple(sizes))


def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
    return draws * 2 + 1


class NgramHasher:
    """Row ids for tokens, given the compressed map, the layout and each sequence's carried look-back."""

    def __init__(self, lookup: list[int], layout: EngramLayout, pad_id: int) -> None:
        self.lookup = np.asarray(lookup, dtype=np.int64)
        self.layout = layout
        self.pad = int(self.lookup[pad_id])
        compressed_vocab = int(self.lookup.max()) + 1
        self.multipliers = np.stack([hash_multipliers(l, layout.max_ngram, compressed_vocab) for l in layout.layer_ids])
        self.primes = np.asarray(layout.primes, dtype=np.int64).reshape(len(layout.layer_ids), -1)  # [L, cols]
        self.offsets = np.asarray(layout.offsets, dtype=np.int64)  # [L, cols]
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @property
    def context_len(self) -> int:
        return self.layout.max_ngram - 1

    def empty_context(self) -> list[int]:
        return [DEAD] * self.context_len

    def ngram_tokens(self, token_ids: list[int], live: list[bool] | None, context: list[int]) -> tuple[np.ndarray, list[int]]:
        """[T, N] compressed look-back (k = 0 current) with blocking; and the context to carry on.

        `context` holds the previous N-1 compressed ids, oldest first (DEAD where none / dead)."""
        n = self.layout.max_ngram
        compressed = self.lookup[np.asarray(token_ids, dtype=np.int64)]
        if live is not None:
            compressed = np.where(np.asarray(live, dtype=bool), compressed, DEAD)
        history = np.concatenate([np.asarray(context, dtype=np.int64), compressed])
        t = len(token_ids)
        back = np.stack([history[self.context_len - k : self.context_len - k + t] for k in range(n)], axis=1)
        blocked = np.cumsum(back == DEAD, axis=1) > 0  # once blocked, blocked for larger k
        tokens = np.where(blocked, self.pad, back)
        return tokens, history[-self.context_len :].tolist()

    def row_ids(self, token_ids: list[int], live: list[bool] | None, context: list[int]) -> tuple[np.ndarray, list[int]]:
        """[T, L, cols] row ids inside each layer's table (offsets included); and the carried context."""
        tokens, carried = self.ngram_tokens(token_ids, live, context)
        return self._hash(tokens), carried

    def next_row_ids(self, token_ids: np.ndarray, contexts: np.ndarray) -> np.ndarray:
        """Row ids [N, L, cols] of one next token for each of N sequences, given their carried contexts
        [N, N-1] (oldest first): one vectorised call for a decode step's sampled tokens."""
        history = np.concatenate([contexts, self.lookup[token_ids][:, None]], axis=1)
        back = history[:, ::-1]  # k = 0 is the token itself
        blocked = np.cumsum(back == DEAD, axis=1) > 0
        return self._hash(np.where(blocked, self.pad, back))

    def next_row_ids_tensor(self, token_ids: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """`next_row_ids` as torch ops on the tensors' device (int64 tokens [N], contexts [N, N-1]):
        a decode step's sampled tokens hashed where they were sampled, with no host sync and a fixed
        number of ops whatever N is. Bitwise the same ids: int64 products never overflow (the
        multipliers' bound) and mixes are non-negative, so `%` agrees with numpy's."""
        lookup, multipliers, primes, offsets = self._tensors(token_ids.device)
        history = torch.cat([contexts, lookup[token_ids][:, None]], dim=1)
        back = history.flip(1)  # k = 0 is the token itself
        blocked = torch.cumsum((back == DEAD).to(torch.int64), dim=1) > 0
        tokens = torch.where(blocked, torch.full_like(back, self.pad), back)
        products = tokens[:, None, :] * multipliers[None]  # [N, L, n]
        mixes = [products[..., 0]]
        for k in range(1, products.shape[-1]):
            mixes.append(mixes[-1] ^ products[..., k])
        per_column = torch.stack(mixes[1:], dim=2).repeat_interleave(self.layout.n_heads, dim=2)
        return per_column % primes[None] + offsets[None]

    def step_row_ids_tensor(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                            context: torch.Tensor) -> torch.Tensor:
        """Row ids [N, L, cols] of a decode step (int64 `slots`, `token_ids`, `positions` [N] on the
        device of `context`, the slots' carried look-backs [slots, N-1], none at position 0), the
        look-backs advanced in place: one kernel on CUDA (kernels/engram_hash.py), else
        `next_row_ids_tensor` and `advance_tensor`, its reference."""
        lookup, multipliers, primes, offsets = self._tensors(token_ids.device)
        if engram_hash.triton is not None and token_ids.is_cuda:
            return engram_hash.hash_decode_rows_triton(slots, token_ids, positions, context, lookup, multipliers,
                                                       primes, offsets, self.pad, self.layout.n_heads)
        return self.step_row_ids_reference(slots, token_ids, positions, context)

    def step_row_ids_reference(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                               context: torch.Tensor) -> torch.Tensor:
        held = context[slots]
        held = torch.where(positions[:, None] == 0, torch.full_like(held, DEAD), held)  # position 0: no past
        row_ids = self.next_row_ids_tensor(token_ids, held.to(torch.int64))
        context[slots] = self.advance_tensor(held, token_ids)
        return row_ids

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The lookup, multipliers, primes and offsets as tensors on `device`, copied there once."""
        cached = self._on_device.get(device)
        if cached is None:
            arrays = (self.lookup, self.multipliers, self.primes, self.offsets)
            cached = self._on_device[device] = tuple(torch.from_numpy(a).to(device) for a in arrays)
        return cached

    def advance(self, contexts: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """The carried contexts [N, N-1] (oldest first) after one more token each."""
        return np.concatenate([contexts, self.lookup[token_ids][:, None]], axis=1)[:, 1:]

    def advance_tensor(self, contexts: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """`advance` as torch ops on the tensors' device."""
        lookup = self._tensors(token_ids.device)[0]
        return torch.cat([contexts, lookup[token_ids][:, None].to(contexts.dtype)], dim=1)[:, 1:]

    def _hash(self, tokens: np.ndarray) -> np.ndarray:
        """[T, N] compressed look-back (k = 0 current, blocking applied) -> [T, L, cols] row ids."""
        n_heads = self.layout.n_heads
        products = tokens[:, None, :] * self.multipliers[None, :, :]  # [T, L, N]
        mixes = np.bitwise_xor.accumulate(products, axis=2)[:, :, 1:]  # order n = k + 1 uses mix after k
        per_column = np.repeat(mixes, n_heads, axis=2)  # [T, L, cols], column (n-2)*heads + head
        return per_column % self.primes[None] + self.offsets[None]
