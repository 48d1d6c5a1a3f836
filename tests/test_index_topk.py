"""The indexer's prefill top-k in tiles (kernels/index_topk.py) against whole score rows, and its
workspace: bounded by the tile, not by the context."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import stable_topk
from kernels.index_topk import CandidateBlocks, block_maxima, choose_blocks, expand_blocks, indexer_topk


def integer_inputs(n: int, heads: int, dim: int, total: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Small integers (scores exact in float32 whatever the summation order, so tiles and whole rows
    agree bitwise and ties are real ties), visible counts from 0 to past the end."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (n, heads, dim), generator=generator).float()
    keys = torch.randint(-2, 3, (total, dim), generator=generator).to(torch.bfloat16)
    weights = torch.randint(1, 3, (n, heads), generator=generator).float()
    visible = torch.randint(0, total + 3, (n,), generator=generator)
    visible[0], visible[1] = 0, total
    return q, weights, keys, visible


def whole_rows(q, weights, keys, visible) -> torch.Tensor:
    per_head = torch.relu(torch.einsum("nhd,td->nht", q, keys.float())) * q.shape[-1] ** -0.5
    scores = (per_head * weights[..., None]).sum(dim=1)
    return scores.masked_fill(torch.arange(keys.shape[0])[None, :] >= visible[:, None], float("-inf"))


def top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    values, ids = stable_topk(scores, min(k, scores.shape[1]))
    return ids.masked_fill(values == float("-inf"), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiles_pick_the_ids_of_whole_rows_in_order_with_ties_to_the_lowest(seed):
    q, weights, keys, visible = integer_inputs(n=37, heads=3, dim=16, total=203, seed=seed)
    rows = whole_rows(q, weights, keys, visible)
    rule = CandidateBlocks(block_size=8, top_blocks=5)
    chosen = choose_blocks(block_maxima(rows, 8), visible, rule)
    for tile_bytes, key_tile in ((1 << 30, 4096), (4 * 3 * 24 * 5, 24), (1, 8)):  # one tile; 5 rows x 24 keys; 1 x 8
        tiles = dict(tile_bytes=tile_bytes, key_tile=key_tile)
        for k in (1, 17, 300):
            plain = indexer_topk(q, weights, keys, visible, k, **tiles)
            assert torch.equal(plain.ids, top_ids(rows, k)) and plain.blocks is None
            source = indexer_topk(q, weights, keys, visible, k, candidates=rule, **tiles)
            assert torch.equal(source.ids, plain.ids) and torch.equal(source.blocks, chosen)
            constrained = indexer_topk(q, weights, keys, visible, k, allowed=(chosen, 8), **tiles)
            masked = rows.masked_fill(~expand_blocks(chosen, rows.shape[1], 8), float("-inf"))
            assert torch.equal(constrained.ids, top_ids(masked, k))
    assert (rows == rows.amax(dim=1, keepdim=True)).sum(dim=1).max() > 1  # the inputs do hold ties


def test_a_mask_over_fewer_entries_leaves_the_rest_out():
    """A constrained source may have more entries than the candidate source's mask covers: those
    past it are never picked, also when a whole key tile lies past it."""
    q, weights, keys, visible = integer_inputs(n=6, heads=2, dim=8, total=64, seed=3)
    chosen = torch.ones(6, 3, dtype=torch.bool)  # blocks of 8: entries 0..23
    pick = indexer_topk(q, weights, keys, visible, 40, allowed=(chosen, 8), key_tile=16)
    rows = whole_rows(q, weights, keys, visible)
    rows[:, 24:] = float("-inf")
    assert pick.ids.max() < 24 and torch.equal(pick.ids, top_ids(rows, 40))


def test_no_entries_pick_nothing():
    q, weights, keys, visible = integer_inputs(n=4, heads=2, dim=8, total=0, seed=4)
    assert indexer_topk(q, weights, keys, visible, 8).ids is None


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("total", [2048, 32768])
def test_the_workspace_is_bounded_by_the_tile_at_any_context(total):
    """Issue 24 item 4: no tensor of the selection grows with queries x entries. Whole rows at 32K
    entries would make a [64, 4, 32768] float32 per-head tensor (32 MiB); the tiles stay within four
    times `tile_bytes` (the per-head tile, the merged top-k's values and int64 indices, the block
    maxima of a row tile), at 2K entries and at 32K alike."""
    q, weights, keys, visible = integer_inputs(n=64, heads=4, dim=16, total=total, seed=5)
    tile_bytes = 64 * 1024
    for options in ({}, {"candidates": CandidateBlocks(8, 16)}):
        with LargestTensor() as seen:
            pick = indexer_topk(q, weights, keys, visible, 32, tile_bytes=tile_bytes, key_tile=256, **options)
        outputs = {pick.ids.numel() * 8, 0 if pick.blocks is None else pick.blocks.numel()}
        assert seen.largest <= max(4 * tile_bytes, *outputs), (total, options, seen.largest)
    assert 64 * 4 * total * 4 > 4 * tile_bytes  # the whole rows' per-head tensor would not fit the bound


@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_picks_are_the_whole_rows_a_query_at_a_time(seed):
    """Deterministic mode's top-k (`topk_per_query`): the same ids, in the same order with ties to the
    lowest, and the same candidate blocks as whole score rows give, for a plain, a candidate and a
    constrained source; no entries, no pick."""
    from kernels.index_topk import topk_per_query

    q, weights, keys, visible = integer_inputs(n=21, heads=3, dim=16, total=120, seed=seed)
    rows = whole_rows(q, weights, keys, visible)
    rule = CandidateBlocks(block_size=8, top_blocks=4)
    chosen = choose_blocks(block_maxima(rows, 8), visible, rule)
    for k in (1, 17, 300):
        plain = topk_per_query(q, weights, keys, visible, k)
        assert torch.equal(plain.ids, top_ids(rows, k)) and plain.blocks is None
        source = topk_per_query(q, weights, keys, visible, k, candidates=rule)
        assert torch.equal(source.ids, plain.ids) and torch.equal(source.blocks, chosen)
        constrained = topk_per_query(q, weights, keys, visible, k, allowed=(chosen, 8))
        assert torch.equal(constrained.ids, top_ids(rows.masked_fill(~expand_blocks(chosen, 120, 8), float("-inf")), k))
    assert topk_per_query(q, weights, keys[:0], visible, 8).ids is None


def test_deterministic_picks_hold_one_score_row_at_a_time():
    """No [queries, entries] scores in deterministic mode either: 64 queries over 32K entries would be an
    8 MiB float32 tensor; a query's row is 128 KiB (its sort's int64 indices twice that)."""
    from kernels.index_topk import topk_per_query

    q, weights, keys, visible = integer_inputs(n=64, heads=2, dim=8, total=32768, seed=6)
    with LargestTensor() as seen:
        pick = topk_per_query(q, weights, keys, visible, 16, candidates=CandidateBlocks(64, 4))
    row = 32768 * 8
    assert seen.largest <= max(row * 2, pick.blocks.numel(), keys.numel() * 4), seen.largest
    assert 64 * 32768 * 4 > row * 2
