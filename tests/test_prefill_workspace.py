"""Issue 24 item 4 for the attention's torch path (CPU, packed KV pages, deterministic mode): HCA's
entries grow with the context, and no tensor of a prefill chunk's attention grows with them times the
chunk. The row tiles give the untiled path's outputs; deterministic mode's per-query keys are the ones
the whole mask gave."""

from __future__ import annotations

import pytest
import torch

from models.attention import LimitedEntries, attend_in_row_tiles, attend_keys_and_picked, attend_per_query
from tests.test_index_topk import LargestTensor


def chunk_inputs(n: int, heads: int, dim: int, shared: int, entries: int, picks: int, seed: int):
    """q, shared keys with a causal-looking additive mask, HCA-like entries with per-query limits from
    0 to all of them, picked entries with some invalid."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=generator)
    keys = torch.randn(shared, dim, generator=generator)
    bias = torch.zeros(n, shared).masked_fill(torch.rand(n, shared, generator=generator) < 0.3, float("-inf"))
    bias[:, 0] = 0.0  # every query sees one shared key at least
    limits = torch.randint(0, entries + 1, (n,), generator=generator)
    limits[0], limits[-1] = 0, entries
    limited = LimitedEntries(torch.randn(entries, dim, generator=generator), limits)
    picked = (torch.randn(n, picks, dim, generator=generator), torch.rand(n, picks, generator=generator) < 0.8)
    return q, keys, bias, limited, picked, torch.randn(heads, generator=generator)


def whole_mask(keys, bias, limited):
    """The shared keys and HCA's entries as one key set with one [n, K + E] mask (what the path built)."""
    hidden = torch.arange(limited.entries.shape[0])[None, :] >= limited.limits[:, None]
    entry_bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    return torch.cat([keys, limited.entries]), torch.cat([bias, entry_bias], 1)


@pytest.mark.parametrize("tile_bytes", [1, 40_000, 2**30])  # a row a tile, partial tiles, one tile
def test_row_tiles_give_the_untiled_outputs(tile_bytes):
    q, keys, bias, limited, picked, sinks = chunk_inputs(n=37, heads=4, dim=16, shared=50, entries=90, picks=6, seed=0)
    all_keys, all_bias = whole_mask(keys, bias, limited)
    for chosen in (None, picked):
        want = attend_keys_and_picked(q, all_keys, all_bias, chosen, sinks, 0.25)
        got = attend_in_row_tiles(q, keys, bias, chosen, sinks, 0.25, limited, tile_bytes=tile_bytes)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # without limited entries (CSA, the window alone) the keys are only the shared ones
    torch.testing.assert_close(attend_in_row_tiles(q, keys, bias, picked, sinks, 0.25, tile_bytes=tile_bytes),
                               attend_keys_and_picked(q, keys, bias, picked, sinks, 0.25), rtol=1e-6, atol=1e-6)


def test_deterministic_queries_see_the_keys_the_whole_mask_gave():
    q, keys, bias, limited, picked, sinks = chunk_inputs(n=9, heads=2, dim=8, shared=20, entries=30, picks=3, seed=1)
    all_keys, all_bias = whole_mask(keys, bias, limited)
    assert torch.equal(attend_per_query(q, keys, bias, picked, sinks, 0.5, limited),
                       attend_per_query(q, all_keys, all_bias, picked, sinks, 0.5))


@pytest.mark.parametrize("entries", [2048, 32768])
def test_the_workspace_does_not_grow_with_the_entries_times_the_chunk(entries):
    """64 queries x 4 heads over 32K entries would be a 32 MiB score tensor (and as much for each of the
    softmax's temporaries); the tiles keep every tensor within a few times `tile_bytes`, or the key set
    itself ([K + E, dim]: it grows with the context alone), at 2K entries and at 32K alike."""
    q, keys, bias, limited, picked, sinks = chunk_inputs(n=64, heads=4, dim=16, shared=80, entries=entries, picks=8,
                                                         seed=2)
    tile_bytes = 64 * 1024
    with LargestTensor() as seen:
        out = attend_in_row_tiles(q, keys, bias, picked, sinks, 0.25, limited, tile_bytes=tile_bytes)
    key_set = (80 + entries) * 16 * 4
    assert seen.largest <= max(4 * tile_bytes, key_set, out.numel() * 4), (entries, seen.largest)
    assert 4 * 64 * (80 + entries) * 4 > 4 * tile_bytes  # the untiled scores would not fit the bound
