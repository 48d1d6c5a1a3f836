"""Triton kernels against their torch references, on fresh random inputs. On CPU they run in
Triton's interpreter (TRITON_INTERPRET=1, set by conftest), which checks the kernels' indexing and
arithmetic; tests/test_gpu.py runs the same comparisons compiled on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.hyper import hc_mixes_reference, hc_mixes_triton
from kernels.norm import rms_norm_reference, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_hc_mixes(n: int, tokens: int, seed: int, device: str = DEVICE) -> None:
    generator = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(tokens, (2 + n) * n, generator=generator, device=device) * 3
    base = torch.randn((2 + n) * n, generator=generator, device=device)
    scale = torch.rand(3, generator=generator, device=device) + 0.5
    expected = hc_mixes_reference(logits, base, scale, n, 20, 1e-6)
    for got, want in zip(hc_mixes_triton(logits, base, scale, n, 20, 1e-6), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def norm_inputs(shape: tuple[int, ...], dtype: torch.dtype, weighted: bool, generator: torch.Generator, device: str,
                strided: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, float32 weight or None) for a norm kernel; `strided`: x a column slice of a wider tensor."""
    x = (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
    if strided:
        wide = torch.randn(*shape[:-1], shape[-1] + 5, generator=generator, device=device).to(dtype)
        wide[..., 3:3 + shape[-1]] = x
        x = wide[..., 3:3 + shape[-1]]
    return x, torch.rand(shape[-1], generator=generator, device=device) + 0.5 if weighted else None


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, weighted: bool, seed: int, device: str = DEVICE,
                   strided: bool = False) -> None:
    """`strided`: x is a column slice of a wider tensor (rows read in place, as a paired FP8 linear's
    outputs are)."""
    generator = torch.Generator(device).manual_seed(seed)
    x, weight = norm_inputs(shape, dtype, weighted, generator, device, strided)
    got, want = rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("n", [2, 4])
def test_hc_mixes_kernel_equals_the_reference(n):
    check_hc_mixes(n, tokens=6, seed=n)


def check_hc_site_and_merge(n: int, tokens: int, dim: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> None:
    """The fused mHC site (projection, norm, mixes, collapse with its own pre or a given one, and with
    the sublayer's input norm or not) and merge against the torch ops. Float32 sums run in another order (the split-K projection), so the mixes
    agree within 1e-5 (relative) and the collapse, which sums with those mixes, within 1e-5 (absolute,
    values of magnitude ~1-10) in float32 and one rounding step of its magnitude in bf16."""
    from kernels.hyper import InputNorm, hc_merge_reference, hc_merge_triton, hc_site_reference, hc_site_triton
    from kernels.norm import rms_norm_reference

    generator = torch.Generator(device).manual_seed(seed)
    streams = (torch.randn(tokens, n, dim, generator=generator, device=device) * 2).to(dtype)
    fn = torch.randn((2 + n) * n, n * dim, generator=generator, device=device) / (n * dim) ** 0.5
    base = torch.randn((2 + n) * n, generator=generator, device=device)
    scale = torch.rand(3, generator=generator, device=device) + 0.5
    given = torch.rand(tokens, n, generator=generator, device=device)
    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    input_norm = InputNorm(torch.rand(dim, generator=generator, device=device) + 0.5, 1e-6)
    for collapse_pre in (None, given):
        got = hc_site_triton(streams, fn, base, scale, n, 20, 1e-6, 1e-6, collapse_pre)
        want = hc_site_reference(streams, fn, base, scale, n, 20, 1e-6, 1e-6, collapse_pre)
        for a, b in zip(got[:3], want[:3], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert got[3].dtype == dtype
        torch.testing.assert_close(got[3], want[3], **close)
        normed = hc_site_triton(streams, fn, base, scale, n, 20, 1e-6, 1e-6, collapse_pre, input_norm)[3]
        # the finish's programs a token: the same bits at any count
        for parts in (1, 3) if collapse_pre is None else ():
            for norm, whole in ((None, got), (input_norm, normed)):
                split = hc_site_triton(streams, fn, base, scale, n, 20, 1e-6, 1e-6, collapse_pre, norm, parts=parts)
                assert all(torch.equal(a, b) for a, b in zip(split[:3], got[:3], strict=True))
                assert torch.equal(split[3], whole[3] if norm is None else whole)
        # the reference's normed collapse is the norm of its collapse, as the model computed it before
        assert torch.equal(hc_site_reference(streams, fn, base, scale, n, 20, 1e-6, 1e-6, collapse_pre, input_norm)[3],
                           rms_norm_reference(want[3], input_norm.weight, input_norm.eps))
        assert normed.dtype == dtype
        torch.testing.assert_close(normed, rms_norm_reference(want[3], input_norm.weight, input_norm.eps), **close)
    pre, post, comb, _ = want
    out = (torch.randn(tokens, dim, generator=generator, device=device) * 3).to(dtype)
    merged, expected = hc_merge_triton(streams, post, comb, out), hc_merge_reference(streams, post, comb, out)
    assert merged.dtype == dtype and merged.shape == streams.shape
    torch.testing.assert_close(merged, expected, **close)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("tokens", [3, 70])  # per-token projection; in tiles of 32 tokens (a partial last tile)
def test_hc_site_and_merge_kernels_equal_the_reference(n, tokens):
    from kernels.hyper import PROJECT_TILE_MIN_TOKENS

    assert (tokens >= PROJECT_TILE_MIN_TOKENS) == (tokens == 70)
    check_hc_site_and_merge(n, tokens=tokens, dim=1100, dtype=torch.float32, seed=n)  # a partial last block


def check_router(tokens: int, experts: int, dim: int, top_k: int, dtype: torch.dtype, seed: int,
                 device: str = DEVICE, config=None) -> None:
    """The fused router against the torch ops: hash routing and top-k routing (with ties: equal
    biased scores must pick the lowest index), renormalised or not, a temperature. The logits' float32
    sums run in another order, so weights agree within 1e-5; the experts exactly (scores are spread
    enough that no two differ by less than the sums' rounding, except the planted exact ties). `config`:
    the logits kernel's LogitsConfig (None: the default)."""
    from kernels.router import LOGITS_CONFIG, route_reference, route_triton

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator, device=device).to(dtype)
    weight = (torch.randn(experts, dim, generator=generator, device=device) / dim**0.5 * 4).to(dtype)
    weight[experts // 2] = weight[experts // 2 + 1]  # equal logits for two experts: a tie
    bias = torch.zeros(experts, device=device)
    table = torch.randint(0, experts, (50, top_k), generator=generator, device=device)
    token_ids = torch.randint(0, 50, (tokens,), generator=generator, device=device)
    for hashed in (True, False):
        for renormalize, temperature in ((True, 1.0), (False, 0.7)):
            args = (x, weight, token_ids, top_k, temperature, 1.5, renormalize)
            got = route_triton(*args, bias=bias, table=table if hashed else None, config=config or LOGITS_CONFIG)
            want = route_reference(*args, "sqrtsoftplus", bias=bias, table=table if hashed else None)
            assert torch.equal(got[1], want[1]), (hashed, renormalize)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def check_argmax_logprob(rows: int, vocab: int, seed: int, device: str = DEVICE) -> None:
    """The split greedy draw against torch's argmax + log_softmax: the same token (the lowest index
    among equal maxima, also when they lie in different blocks), its logprob within 1e-5, and a NaN
    logprob for rows holding NaN or +inf, or only -inf."""
    from kernels.argmax import SPLIT, argmax_logprob_reference, argmax_logprob_triton

    generator = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, device=device) * 4
    logits[1, [7, SPLIT + 3]] = logits[1].max() + 1  # a tie across two blocks: the lower index wins
    logits[2, 5] = float("nan")
    logits[3, 9] = float("inf")
    logits[4] = float("-inf")
    logits[5, :SPLIT] = float("-inf")  # a whole block of -inf adds nothing
    tokens, chosen = argmax_logprob_triton(logits)
    want_tokens, want = argmax_logprob_reference(logits)
    finite = torch.isfinite(want)
    assert finite.tolist() == torch.isfinite(chosen).tolist() and finite[2:5].sum() == 0
    assert torch.equal(tokens[finite], want_tokens[finite]) and int(tokens[1]) == 7
    torch.testing.assert_close(chosen[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_argmax_logprob_kernels_equal_the_reference():
    check_argmax_logprob(rows=7, vocab=2 * 2048 + 300, seed=0)


def test_router_kernels_equal_the_reference():
    check_router(tokens=3, experts=24, dim=700, top_k=6, dtype=torch.float32, seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_router_logits_in_tiles_equal_the_reference(dtype):
    """A prefill chunk's logits in tiles of tokens x experts (float32 or half-precision dots), partial
    tiles of both, shares past the last channel. float16 stands for the half-precision dot here: Triton
    3.9's interpreter multiplies bfloat16 tiles wrongly (its dots of bf16 ones are garbage), so the GPU
    test checks bf16 compiled."""
    from kernels.router import TILE_MIN_TOKENS, TILE_TOKENS

    tokens = TILE_TOKENS + 9
    assert tokens >= TILE_MIN_TOKENS
    check_router(tokens=tokens, experts=72, dim=700, top_k=6, dtype=dtype, seed=2)


def test_router_logits_split_over_channels_equal_the_reference():
    """The logits kernel's knobs: one share, or more shares than the 700 channels fill (the last ones
    empty, storing zeros), expert blocks that do not divide the 24 experts."""
    from kernels.router import LogitsConfig

    for config in (LogitsConfig(16, 128, 1, 4), LogitsConfig(8, 64, 16, 2), LogitsConfig(32, 256, 2, 4)):
        check_router(tokens=2, experts=24, dim=700, top_k=6, dtype=torch.float32, seed=1, config=config)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_the_reference(dtype, weighted):
    check_rms_norm((3, 1500), dtype, weighted, seed=1)  # two blocks of 1024, the second partial
    check_rms_norm((2, 4, 32), dtype, weighted, seed=2)  # per head, one short block
    check_rms_norm((3, 1500), dtype, weighted, seed=3, strided=True)
    check_rms_norm((2, 4, 32), dtype, weighted, seed=4, strided=True)


def check_rms_norm_rope(shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype, weighted: bool, seed: int,
                        device: str = DEVICE, strided: bool = False) -> None:
    """The norm-then-rope kernel is bitwise the norm kernel followed by the in-place rope kernel, and
    within the norm's tolerance of the torch ops (per head and per row, a strided input as a paired FP8
    linear's outputs are)."""
    from kernels.norm import rms_norm_rope, rms_norm_triton
    from kernels.rope import apply_rope_reference, apply_rope_triton_

    generator = torch.Generator(device).manual_seed(seed)
    x, weight = norm_inputs(shape, dtype, weighted, generator, device, strided)
    angles = torch.rand(shape[0], rope_dim // 2, generator=generator, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    got = rms_norm_triton(x, weight, 1e-6, (cos, sin))
    assert torch.equal(got, apply_rope_triton_(rms_norm_triton(x, weight, 1e-6), cos, sin))
    want = apply_rope_reference(rms_norm_reference(x, weight, 1e-6), cos, sin)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    if device == "cuda":  # the dispatch the models call
        assert torch.equal(rms_norm_rope(x, weight, 1e-6, cos, sin), got)


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_rope_kernel_is_the_norm_then_the_rope(weighted):
    check_rms_norm_rope((3, 4, 32), 8, torch.float32, weighted, seed=1)  # q heads
    check_rms_norm_rope((5, 1100), 16, torch.bfloat16, weighted, seed=2)  # a kv row of two blocks, the second partial
    check_rms_norm_rope((2, 64), 64, torch.float32, weighted, seed=3, strided=True)  # every channel turned


def check_decode_attention(batch: int, heads: int, n_keys: int, dim: int, dtype: torch.dtype, seed: int,
                           device: str = DEVICE) -> None:
    from kernels.attention import decode_attention_reference, decode_attention_triton

    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=generator, device=device).to(dtype)
    keys = torch.randn(batch, n_keys, dim, generator=generator, device=device).to(dtype)
    valid = torch.rand(batch, n_keys, generator=generator, device=device) < 0.7
    valid[0] = False  # a sequence with nothing visible: only the sink, so zeros
    valid[1, 64:128] = False  # a whole split of 64 keys with nothing visible
    sinks = torch.randn(heads, generator=generator, device=device)
    got = decode_attention_triton(q, keys, valid, sinks, dim**-0.5)
    want = decode_attention_reference(q.float(), keys.float(), valid, sinks, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    assert not got[0].any()


def test_decode_attention_kernel_equals_the_reference():
    """Heads not a multiple of the 16-head block, keys not a multiple of the 32-key block, one split
    of 64 keys or three (the second empty for sequence 1)."""
    check_decode_attention(batch=3, heads=20, n_keys=45, dim=32, dtype=torch.float32, seed=0)
    check_decode_attention(batch=3, heads=20, n_keys=150, dim=32, dtype=torch.float32, seed=1)


def check_decode_attention_in_place(batch: int, heads: int, window: int, dim: int, dtype: torch.dtype, seed: int,
                                    device: str = DEVICE) -> None:
    """The in-place kernel over a ring and paged entries (by picked ids, or all of them) against the
    gathered kernel on the same keys (same keys, order and tiles: the same bits in Triton's interpreter;
    compiled, the tiles' products may be ordered differently, so within bf16 rounding) and the reference:
    positions before the ring fills, a window not a multiple of the 64-key split, picked ids past
    the visible entries or -1, and a sequence with no visible entry."""
    from kernels.attention import (
        DecodeKeys,
        decode_attention_in_place_triton,
        decode_attention_reference,
        decode_attention_triton,
        gathered_keys_reference,
    )

    generator = torch.Generator(device).manual_seed(seed)
    slots, pages, per_page, width, rate = 6, 40, 4, 5, 4

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    q, ring, entries = rand(batch, heads, dim), rand(slots, window, dim), rand(pages, per_page, dim)
    sinks = torch.randn(heads, generator=generator, device=device)
    # slots and positions as strided columns of one buffer, as the decode graphs pass them; ids a slice
    inputs = torch.zeros(batch, 3, dtype=torch.long, device=device)
    slot_of, positions = inputs[:, 0], inputs[:, 1]
    slot_of.copy_(torch.randperm(slots, generator=generator, device=device)[:batch])
    positions.copy_(torch.randint(0, width * per_page * rate, (batch,), generator=generator, device=device))
    positions[0], positions[1] = 2, window + 3  # a ring not full yet (and no closed entry), then one past it
    tables = torch.randperm(pages, generator=generator, device=device)[: batch * width].view(batch, width)
    ids = torch.randint(-1, width * per_page, (batch, 11), generator=generator, device=device)[:, 2:]
    for source in (
        DecodeKeys(ring, slot_of, positions),
        DecodeKeys(ring, slot_of, positions, entries, tables, None, rate),  # HCA: every entry
        DecodeKeys(ring, slot_of, positions, entries, tables, ids, rate),  # CSA: picked ids
        DecodeKeys(ring, slot_of, positions, entries, tables, ids, 0),  # V4.1: no limit by position
        DecodeKeys(ring, slot_of, positions, entries, tables, ids, rate, window - 3),  # 3 ring rows for drafts
    ):
        keys, valid = gathered_keys_reference(source)
        got = decode_attention_in_place_triton(q, source, sinks, dim**-0.5)
        gathered = decode_attention_triton(q, keys, valid, sinks, dim**-0.5)
        if device == "cpu":
            assert torch.equal(got, gathered)
        else:
            torch.testing.assert_close(got, gathered, rtol=1e-2, atol=1e-2)
        want = decode_attention_reference(q.float(), keys.float(), valid, sinks, dim**-0.5)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def test_decode_attention_in_place_equals_the_gathered_kernel():
    check_decode_attention_in_place(batch=4, heads=20, window=40, dim=32, dtype=torch.float32, seed=0)
    check_decode_attention_in_place(batch=3, heads=4, window=64, dim=16, dtype=torch.float32, seed=1)


def check_chunk_attention(n: int, heads: int, span: int, dim: int, dtype: torch.dtype, seed: int,
                          device: str = DEVICE) -> None:
    """The prefill chunk kernel against the model's torch path (models.attention.attend_keys_and_picked,
    run in float32) on the same keys: the window alone (a chunk at the sequence's start, the window not
    yet full, and one past it), HCA's every entry limited by position, CSA's picked ids with -1s."""
    from kernels.attention import ChunkKeys, chunk_attention_in_place
    from models.attention import attend_keys_and_picked
    from models.cache import paged_gather

    generator = torch.Generator(device).manual_seed(seed)
    pages, per_page, rate, k = 30, 4, 4, 9

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    entries, sinks = rand(pages, per_page, dim), torch.randn(heads, generator=generator, device=device)
    table = torch.randperm(pages, generator=generator, device=device)
    scale = dim**-0.5
    for p0 in (0, span // 2, 3 * span + 5):
        q = rand(n, heads, dim)
        first = max(0, p0 - span + 1)
        keys = rand(p0 + n - first, dim)
        positions = torch.arange(p0, p0 + n, device=device)
        key_positions = torch.arange(first, p0 + n, device=device)
        seen = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] > positions[:, None] - span)
        bias = torch.zeros(seen.shape, device=device).masked_fill(~seen, float("-inf"))
        window = ChunkKeys(keys, first, positions, span)
        n_entries = (p0 + n) // rate
        visible = torch.arange(n_entries, device=device)[None, :] < ((positions + 1) // rate)[:, None]
        every = paged_gather(entries, table, torch.arange(n_entries, device=device)).float()
        hca_bias = torch.cat([bias, torch.zeros_like(visible, dtype=bias.dtype).masked_fill(~visible, float("-inf"))], 1)
        ids = torch.randint(-1, max(n_entries, 1), (n, k), generator=generator, device=device)
        picked = (paged_gather(entries, table, ids.clamp(min=0)).float(), ids >= 0)
        cases = [
            (window, keys.float(), bias, None),
            (ChunkKeys(keys, first, positions, span, entries, table, None, n_entries, rate),
             torch.cat([keys.float(), every]), hca_bias, None),
            (ChunkKeys(keys, first, positions, span, entries, table, ids, k, 0), keys.float(), bias, picked),
        ]
        for source, all_keys, all_bias, chosen in cases:
            got = chunk_attention_in_place(q, source, sinks, scale)
            want = attend_keys_and_picked(q.float(), all_keys, all_bias, chosen, sinks, scale)
            assert got.dtype == dtype and got.shape == q.shape
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def test_chunk_attention_kernel_equals_the_models_prefill_path():
    check_chunk_attention(n=6, heads=20, span=40, dim=32, dtype=torch.float32, seed=0)  # two window tiles
    check_chunk_attention(n=5, heads=4, span=8, dim=16, dtype=torch.float32, seed=1)


def test_gathered_keys_reference_is_the_models_gather():
    """The reference gather equals the model's for packed stores: the ring masked by position
    (models.attention's gathered_window after the append) and the picked entries through the block
    tables."""
    from kernels.attention import DecodeKeys, gathered_keys_reference
    from models.attention import gathered_window, window_append
    from models.batch import DecodeBatch
    from models.cache import paged_gather_rows

    generator = torch.Generator().manual_seed(3)
    ring, entries = torch.randn(3, 8, 4, generator=generator), torch.randn(10, 2, 4, generator=generator)
    batch = DecodeBatch.build([(2, 0, 5, [3, 1, 7]), (0, 0, 30, [9, 2, 4])])
    kv = torch.randn(2, 4, generator=generator)
    window_append(batch, kv, ring)
    keys, valid = gathered_window(batch, ring, 6)  # a ring of 8 rows (6 + 2 for drafts)
    ids = torch.tensor([[0, 5, 1], [2, -1, 4]])
    got_keys, got_valid = gathered_keys_reference(DecodeKeys(ring, batch.slots, batch.positions, entries,
                                                              batch.block_tables, ids, 4, 6))
    picked = paged_gather_rows(entries, batch.block_tables, ids.clamp(min=0))
    assert torch.equal(got_keys, torch.cat([keys, picked], dim=1))
    limit = (batch.positions[:, None] + 1) // 4
    assert torch.equal(got_valid, torch.cat([valid, (ids >= 0) & (ids < limit)], dim=1))


def check_moe_pairs(tokens: int, k: int, dim: int, shares: int, seed: int, device: str = DEVICE) -> None:
    """The pair table and the per-token sum against their references, bitwise: experts of other ranks
    (ids outside [first, first + held)) with NaN in their unwritten rows, any share count, weights
    applied or not, with and without the shared expert's bf16 output added."""
    from kernels.moe_pairs import pair_table_reference, pair_table_triton, sum_pairs_reference, sum_pairs_triton

    generator = torch.Generator(device).manual_seed(seed)
    first, held = 8, 16
    experts = torch.randint(0, 32, (tokens, k), generator=generator, device=device)
    weights = torch.rand(tokens, k, generator=generator, device=device)
    got, want = pair_table_triton(experts, weights, first, held), pair_table_reference(experts, weights, first, held)
    assert got[0].dtype == torch.int32 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    expert_of, weight = want
    partial = torch.randn(shares, tokens * k, dim, generator=generator, device=device)
    partial[:, expert_of < 0] = float("nan")  # another rank's rows are never written
    residual = torch.randn(tokens, dim, generator=generator, device=device).to(torch.bfloat16)
    for weighted in (True, False):
        for plus in (None, residual):
            out = sum_pairs_triton(partial, expert_of, weight, k, weighted, plus)
            expected = sum_pairs_reference(partial, expert_of, weight, k, weighted, plus)
            assert out.dtype == expected.dtype
            if plus is None or device == "cuda":
                assert torch.equal(out, expected)
            else:  # Triton's interpreter casts to bf16 by truncation: one bf16 step at most
                torch.testing.assert_close(out, expected, rtol=2**-7, atol=0)
    assert not sum_pairs_reference(partial, expert_of, weight, k, False).isnan().any()
    # rows in another order (the grouped GEMMs' sorted rows), read through the pair -> row map, in float32
    # and as bf16 GEMM output: the same sums as rows in pair order
    order = torch.randperm(tokens * k, generator=generator, device=device)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(tokens * k, device=device)
    for rows in (partial, partial.to(torch.bfloat16)):
        shuffled = rows[:, order]
        for weighted in (True, False):
            expected = sum_pairs_reference(rows, expert_of, weight, k, weighted)
            assert torch.equal(sum_pairs_reference(shuffled, expert_of, weight, k, weighted, rows=row_of), expected)
            assert torch.equal(sum_pairs_triton(shuffled, expert_of, weight, k, weighted, rows=row_of), expected)


def check_swiglu_pairs(pairs: int, inter: int, shares: int, seed: int, device: str = DEVICE) -> None:
    """The activation between the experts' GEMMs against its reference: float32 partial sums over K
    shares or one bf16 GEMM output, the weight applied or not, bf16 or float32 out; another rank's rows
    (NaN, never written) left alone. Triton's exp is not torch's: within one step of the output dtype."""
    from kernels.moe_pairs import swiglu_pairs_reference, swiglu_pairs_triton

    generator = torch.Generator(device).manual_seed(seed)
    expert_of = torch.randint(-1, 4, (pairs,), generator=generator, device=device, dtype=torch.int32)
    weight = torch.rand(pairs, generator=generator, device=device)
    mine = expert_of >= 0
    for partial in (torch.randn(shares, pairs, 2 * inter, generator=generator, device=device) * 4,
                    (torch.randn(1, pairs, 2 * inter, generator=generator, device=device) * 4).to(torch.bfloat16)):
        partial[:, ~mine] = float("nan")
        for weighted in (True, False):
            for dtype in (torch.bfloat16, torch.float32):
                got = swiglu_pairs_triton(partial, expert_of, weight, 3.0, weighted, dtype=dtype)
                want = swiglu_pairs_reference(partial, expert_of, weight, 3.0, weighted, dtype)
                assert got.dtype == want.dtype == dtype and not want.isnan().any()
                step = 2**-7 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got[mine].float(), want[mine].float(), rtol=step, atol=step)


def test_swiglu_pairs_kernel_equals_its_reference():
    check_swiglu_pairs(pairs=7, inter=300, shares=3, seed=0)  # inter: a partial second block of 256


def test_moe_pair_kernels_equal_their_references():
    check_moe_pairs(tokens=5, k=6, dim=300, shares=1, seed=0)  # dim: a partial second block of 256
    check_moe_pairs(tokens=3, k=2, dim=64, shares=3, seed=1)


def check_clamped_swiglu(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = DEVICE,
                         side_by_side: bool = False) -> None:
    """`side_by_side`: gate and up are the two column halves of one tensor (a paired FP8 linear's output)."""
    from kernels.moe import clamped_swiglu_reference, clamped_swiglu_triton

    generator = torch.Generator(device).manual_seed(seed)
    if side_by_side:
        both = (torch.randn(*shape[:-1], 2 * shape[-1], generator=generator, device=device) * 6).to(dtype)
        gate, up = both.split(shape[-1], dim=-1)
    else:
        gate = (torch.randn(shape, generator=generator, device=device) * 6).to(dtype)
        up = (torch.randn(shape, generator=generator, device=device) * 6).to(dtype)
    got, want = clamped_swiglu_triton(gate, up, 7.0), clamped_swiglu_reference(gate, up, 7.0)
    assert got.dtype == want.dtype and got.abs().max() <= 7.0 * 7.0
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_clamped_swiglu_kernel_equals_the_reference():
    """Values past the clamp of 7 on both sides, and a length not a multiple of the 1024-element block."""
    check_clamped_swiglu((3, 700), torch.float32, seed=0)
    check_clamped_swiglu((3, 700), torch.float32, seed=1, side_by_side=True)


def check_rope(shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> None:
    from kernels.rope import apply_rope_, apply_rope_reference, apply_rope_triton, apply_rope_triton_

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(shape, generator=generator, device=device).to(dtype)
    angles = torch.rand(shape[0], rope_dim // 2, generator=generator, device=device) * 6
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
    for sign in (1, -1):
        got, want = apply_rope_triton(x, cos, sign * sin), apply_rope_reference(x, cos, sign * sin)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        assert torch.equal(got[..., :-rope_dim], x[..., :-rope_dim])
        for in_place in (apply_rope_triton_, apply_rope_):  # the kernel, and the reference path off CUDA
            turned = x.clone()
            assert in_place(turned, cos, sign * sin) is turned
            assert torch.equal(turned, got if in_place is apply_rope_triton_ or x.is_cuda else want)
            back = x.clone()  # inverse: the rotation by -sin, without a negated copy
            assert in_place(back, cos, -sign * sin, inverse=True) is back
            assert torch.equal(back, turned)


def check_rope_table(n: int, half: int, rate: int, seed: int, device: str = DEVICE) -> None:
    """The table kernel against torch's six operations: positions up to V4's 1M context (large angles:
    the cosine's range reduction), a YaRN-like scale, negative positions rounded down as torch floors,
    read from a strided column (a decode graph's static input rows)."""
    from kernels.rope import rope_table_reference, rope_table_triton

    generator = torch.Generator(device).manual_seed(seed)
    positions = torch.randint(-rate, 1 << 20, (n, 3), generator=generator, device=device)[:, 1]  # a column, as graphs pass
    inv_freq = 10000.0 ** -(torch.arange(half, device=device, dtype=torch.float32) / half)
    got = rope_table_triton(positions, inv_freq, 1.25, rate)
    want = rope_table_reference(positions, inv_freq, 1.25, rate)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == (n, half)
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)  # float32 cos / sin: an ulp or two of 1.25


def test_rope_table_kernel_equals_the_reference():
    check_rope_table(37, 32, 1, seed=0)  # rows past a program's last
    check_rope_table(5, 12, 4, seed=1)  # half not a power of two; a compressed entry's rounding
    check_rope_table(16, 8, 128, seed=2)


def test_rope_kernel_equals_the_reference():
    check_rope((5, 3, 32), 8, torch.float32, seed=0)  # per head
    check_rope((4, 16), 16, torch.float32, seed=1)  # every channel rotated
    check_rope((37, 2, 64), 16, torch.bfloat16, seed=2)  # rows past a program's last, in bf16


def check_experts_pairwise(tokens: int, dtype: torch.dtype, seed: int, device: str = DEVICE,
                           dim: int = 48, inter: int = 40, mxfp4: bool = False) -> None:
    """This rank holds experts [2, 6) of 8: the others' pairs must add nothing. `mxfp4`: the weights
    as released (E2M1 codes + E8M0 scales), which the reference dequantizes exactly."""
    from kernels.moe import MXFP4Experts, experts_pairwise, experts_reference
    from kernels.quant import quantize_mxfp4

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator, device=device).to(dtype)
    experts = torch.randint(0, 8, (tokens, 3), generator=generator, device=device)
    weights = torch.rand(tokens, 3, generator=generator, device=device)
    gate_up = (torch.randn(4, 2 * inter, dim, generator=generator, device=device) / dim**0.5).to(dtype)
    down = (torch.randn(4, dim, inter, generator=generator, device=device) / inter**0.5).to(dtype)
    if mxfp4:
        gate_up, down = (MXFP4Experts(*quantize_mxfp4(w)) for w in (gate_up, down))
        plain = [torch.stack([w.expert(e, dtype) for e in range(4)]) for w in (gate_up, down)]
        args = (x, weights, experts, gate_up, down, 2, 1.5, True)
        assert torch.equal(experts_reference(*args), experts_reference(x, weights, experts, *plain, 2, 1.5, True))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for before_down in (False, True):
        args = (x, weights, experts, gate_up, down, 2, 1.5, before_down)
        torch.testing.assert_close(experts_pairwise(*args), experts_reference(*args), rtol=tolerance, atol=tolerance)


def test_pairwise_experts_kernels_equal_the_reference():
    """Row and column counts that are not multiples of the 32 x 128 blocks; limit 1.5 clamps."""
    check_experts_pairwise(tokens=3, dtype=torch.float32, seed=0)


def test_pairwise_experts_kernels_decode_mxfp4_weights():
    check_experts_pairwise(tokens=3, dtype=torch.float32, seed=1, dim=64, inter=96, mxfp4=True)


def check_experts_mxfp4_tensor_cores(tokens: int, seed: int, device: str = DEVICE, dim: int = 64, inter: int = 96,
                                     blocks: dict | None = None, routed: tuple[int, int] = (0, 8),
                                     upcasts: tuple[str, ...] = ("dot_scaled", "bits"),
                                     splits: tuple[tuple[int, int] | None, ...] = (None,), mma_layout: bool = False,
                                     ) -> None:
    """kernels/moe_mxfp4.py's decode (scanning) and prefill (sorted) kernels, with each of `upcasts`
    (the GPU test adds "ptx", which the interpreter cannot run), against the reference on MXFP4 weights; this rank holds experts [2, 6) of 8 and the
    tokens choose among experts [routed[0], routed[1]). The tolerance is the reference's bf16 rounding
    of gate / up, which the kernels keep in float32. `splits`: the decode kernels' (gate_up, down) K
    shares to try (None: their table's). `mma_layout`: the kernels read the weights as
    kernels/moe_mxfp4_mma.py lays them out (K steps of its CHUNK)."""
    from kernels.moe import MXFP4Experts, experts_reference
    from kernels.moe_mxfp4 import experts_by_expert, experts_sorted
    from kernels.quant import quantize_mxfp4

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator, device=device).bfloat16()
    experts = torch.randint(*routed, (tokens, 3), generator=generator, device=device)
    weights = torch.rand(tokens, 3, generator=generator, device=device)
    gate_up = MXFP4Experts(*quantize_mxfp4(torch.randn(4, 2 * inter, dim, generator=generator, device=device) / dim**0.5))
    down = MXFP4Experts(*quantize_mxfp4(torch.randn(4, dim, inter, generator=generator, device=device) / inter**0.5))
    small = blocks or {"gate_up": (16, 32, 32, 4), "down": (16, 32, 32, 4)}
    for before_down in (False, True):
        want = experts_reference(x, weights, experts, gate_up, down, 2, 1.5, before_down)
        if mma_layout:
            from kernels.mma_layout import from_released

            args = (x, weights, experts, from_released(gate_up.codes, gate_up.scales),
                    from_released(down.codes, down.scales), 2, 1.5, before_down)
        else:
            args = (x, weights, experts, gate_up, down, 2, 1.5, before_down)
        for upcast in upcasts:
            runs = [lambda: experts_sorted(*args, blocks=small, upcast=upcast)]
            runs += [lambda shares=shares: experts_by_expert(*args, blocks=small, upcast=upcast, splits=shares)
                     for shares in splits]
            for run in runs:
                torch.testing.assert_close(run(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_prefill_takes_the_large_tiles_from_their_pair_count():
    from kernels.moe_mxfp4 import LARGE_PREFILL_BLOCKS, LARGE_PREFILL_PAIRS, PREFILL_BLOCKS, prefill_blocks

    assert prefill_blocks(2048 * 6) is PREFILL_BLOCKS  # a 2,048-token chunk at top-6
    assert prefill_blocks(LARGE_PREFILL_PAIRS - 1) is PREFILL_BLOCKS
    assert prefill_blocks(LARGE_PREFILL_PAIRS) is LARGE_PREFILL_BLOCKS and prefill_blocks(8192 * 6) is LARGE_PREFILL_BLOCKS
    assert LARGE_PREFILL_BLOCKS["gate_up"][0] == LARGE_PREFILL_BLOCKS["down"][0]  # one block table for both


def test_mxfp4_tensor_core_experts_equal_the_reference():
    """Row and column counts that are not multiples of the blocks; ~18 pairs an expert, more than a
    block of 16 holds (the scanning kernel's second block of an expert); expert 1 is another rank's."""
    check_experts_mxfp4_tensor_cores(tokens=24, seed=3, routed=(1, 5))


def test_mxfp4_tensor_core_experts_read_the_mma_layout():
    """The same kernels on weights laid out for kernels/moe_mxfp4_mma.py (a bf16 model on an sm_90 GPU
    holds them so; prefill chunks then run the sorted kernel on them): the codes are read as stored, x's
    columns and gate_up's output rows (so down's input columns) follow the layout's CODE_ORDER, and
    the products are the reference's; ~18 pairs an expert, expert 1 another rank's, K in 2 steps of
    128."""
    blocks = {"gate_up": (16, 32, 128, 4), "down": (16, 32, 128, 4)}
    check_experts_mxfp4_tensor_cores(tokens=24, seed=4, dim=256, inter=128, routed=(1, 5), blocks=blocks,
                                     mma_layout=True)


def test_mxfp4_scanning_experts_split_k_into_shares(monkeypatch):
    """The decode kernels with K cut into shares (partial sums added by gate_up's last share or the
    reduce kernel, SiLU * up after; down's by the pair sum): 3 K steps of 32 in 2 shares (a short last one) or 3, an expert another rank's,
    routing weights before or after down; bitwise the same on a second run (the shares are added in a
    fixed order, no atomics). The scan reads the expert ids 8 at a time here (SCAN_CHUNK is 256), so
    the 12 pairs take two chunks."""
    import kernels.moe_mxfp4 as mx
    from kernels.moe import MXFP4Experts
    from kernels.quant import quantize_mxfp4

    monkeypatch.setattr(mx, "_SCAN", 8)  # read at run time by the interpreter
    check_experts_mxfp4_tensor_cores(tokens=4, seed=4, dim=96, inter=96, routed=(1, 5), upcasts=("bits",),
                                     splits=((2, 3),))
    generator = torch.Generator(DEVICE).manual_seed(5)
    x = torch.randn(2, 96, generator=generator, device=DEVICE).bfloat16()
    experts = torch.tensor([[2, 3, 1], [5, 2, 4]], device=DEVICE)
    weights = torch.rand(2, 3, generator=generator, device=DEVICE)
    gate_up, down = (MXFP4Experts(*quantize_mxfp4(torch.randn(4, rows, 96, generator=generator, device=DEVICE) / 10))
                     for rows in (192, 96))
    small = {"gate_up": (16, 32, 32, 4, 2), "down": (16, 32, 32, 4, 2)}
    run = lambda last_sums=True: mx.experts_by_expert(x, weights, experts, gate_up, down, 2, 1.5, False,  # noqa: E731
                                                      blocks=small, upcast="bits", splits=(3, 2), last_sums=last_sums)
    assert torch.equal(run(), run())
    assert torch.equal(run(), run(last_sums=False))  # gate_up's last share adds the shares: the sum kernel's bits


def test_mxfp4_decode_split_table_covers_every_scanned_pair_count():
    from kernels.moe_mxfp4 import DECODE_SPLITS, MAX_SCAN_PAIRS, decode_splits

    assert [row[0] for row in DECODE_SPLITS] == sorted(row[0] for row in DECODE_SPLITS)
    assert DECODE_SPLITS[-1][0] >= MAX_SCAN_PAIRS
    assert all(min(decode_splits(pairs)) >= 1 for pairs in range(1, MAX_SCAN_PAIRS + 1))


def check_indexer_scores(batch: int, heads: int, dim: int, per_page: int, width: int, store_dtype: torch.dtype,
                         seed: int, device: str = DEVICE) -> None:
    from kernels.indexer import indexer_scores_reference, indexer_scores_triton

    generator = torch.Generator(device).manual_seed(seed)
    store = torch.randn(3 * width, per_page, dim, generator=generator, device=device).to(store_dtype)
    tables = torch.stack([torch.randperm(3 * width, generator=generator, device=device)[:width] for _ in range(batch)])
    q = torch.randn(batch, heads, dim, generator=generator, device=device)
    weights = torch.randn(batch, heads, generator=generator, device=device)
    visible = torch.randint(0, width * per_page + 1, (batch,), generator=generator, device=device)
    got = indexer_scores_triton(q, weights, store, tables, visible)
    want = indexer_scores_reference(q, weights, store, tables, visible)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the models' call: q and the weights in the model's dtype, the weights' scale applied by the kernel
    q16, weights16 = q.to(torch.bfloat16), weights.to(torch.bfloat16)
    got = indexer_scores_triton(q16, weights16, store, tables, visible, weight_scale=heads**-0.5)
    want = indexer_scores_reference(q16.float(), weights16.float() * heads**-0.5, store, tables, visible)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_scores_kernel_equals_the_reference():
    """Pages out of order, an entry count that is not a multiple of the 32-entry block, and every
    sequence at its own visible length (the rest -inf)."""
    check_indexer_scores(batch=3, heads=5, dim=16, per_page=4, width=9, store_dtype=torch.float32, seed=0)


def check_unpack_fp4(rows: int, dim: int, seed: int, device: str = DEVICE) -> None:
    """Both scale formats, values over many binades (e4m3 subnormal scales included, and e4m3's NaN
    byte 0x7F, which torch's CUDA cast gives a scale past 448; the CPU cast saturates), float32 and bf16."""
    from kernels.kv_pack import (
        pack_fp4_e4m3,
        pack_fp4_ue8m0,
        unpack_fp4_reference,
        unpack_fp4_triton,
    )

    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, dim, generator=generator, device=device) * torch.logspace(-6, 3, rows, device=device)[:, None]
    e4m3 = pack_fp4_e4m3(x)
    e4m3.scales[-1, 0] = 0x7F
    for packed in (e4m3, pack_fp4_ue8m0(x)):
        for dtype in (torch.float32, torch.bfloat16):
            kernel, reference = unpack_fp4_triton(packed, dtype), unpack_fp4_reference(packed, dtype)
            assert torch.equal(kernel.isnan(), reference.isnan())
            assert torch.equal(kernel.nan_to_num(), reference.nan_to_num())
            assert reference.isnan().any() == (packed.scale_format == "e4m3")


def test_unpack_fp4_kernel_is_bitwise_the_reference():
    check_unpack_fp4(rows=9, dim=64, seed=0)


def check_fp8_linear(rows: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = DEVICE, block: int = 128,
                     path: str = "splitk", config: tuple[int, ...] | None = None) -> None:
    """Sizes that are not multiples of the tiles or of the blocks; a weight tile with subnormal and
    negative values; bf16 within bf16's rounding of the reference, float32 close. `path`: "splitk"
    (fp8_linear_triton, decode; `config` its DecodeConfig) or "tc" (fp8_linear_tc, tensor-core tiles;
    `config` its tile shape)."""
    from kernels.fp8_linear import (
        fp8_linear_reference,
        fp8_linear_tc,
        fp8_linear_triton,
    )
    generator = torch.Generator(device).manual_seed(seed)
    weight, scale = random_fp8_weight(n, k, block, generator, device)
    x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
    if path == "splitk":
        got = fp8_linear_triton(x, weight, scale, block, config)
    else:
        got = fp8_linear_tc(x, weight, scale, block, config)
    want = fp8_linear_reference(x, weight, scale, block)
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * k**0.5)


def check_fp8_linear_pair(rows: int, n1: int, n2: int, k: int, dtype: torch.dtype, seed: int, device: str = DEVICE,
                          block: int = 128) -> None:
    """Two weights on one x in one launch: each output as `fp8_linear_reference` gives it (within the
    split-K kernel's tolerance), as column slices of one tensor; the first N a multiple of the column
    tile, the second not; a first N off the tile is refused."""
    from kernels.fp8_linear import decode_config, fp8_linear_pair_triton, fp8_linear_reference

    generator = torch.Generator(device).manual_seed(seed)
    first = random_fp8_weight(n1, k, block, generator, device)
    second = random_fp8_weight(n2, k, block, generator, device)
    x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
    y1, y2 = fp8_linear_pair_triton(x, first, second, block)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for got, (weight, scale) in ((y1, first), (y2, second)):
        want = fp8_linear_reference(x, weight, scale, block)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * k**0.5)
    assert y1.untyped_storage().data_ptr() == y2.untyped_storage().data_ptr()  # one output tensor
    odd = random_fp8_weight(decode_config(block, rows).block_n + 1, k, block, generator, device)
    with pytest.raises(ValueError, match="column tile"):
        fp8_linear_pair_triton(x, odd, second, block)


def check_fp8_grouped_linear(rows: int, groups: int, n_group: int, k: int, dtype: torch.dtype, seed: int,
                             device: str = DEVICE, block: int = 128) -> None:
    """A block-diagonal FP8 projection (o_a_proj) by the split-K kernel: within its tolerance of the
    reference (W dequantized, each group's product); K not a multiple of the block; groups whose N is
    off the column tile are refused."""
    from kernels.fp8_linear import decode_config, fp8_grouped_linear_reference, fp8_grouped_linear_triton

    generator = torch.Generator(device).manual_seed(seed)
    weight, scale = random_fp8_weight(groups * n_group, k, block, generator, device)
    x = torch.randn(rows, groups * k, generator=generator, device=device).to(dtype)
    got = fp8_grouped_linear_triton(x, weight, scale, groups, block)
    want = fp8_grouped_linear_reference(x, weight, scale, groups, block)
    assert got.dtype == dtype and got.shape == want.shape == (rows, groups * n_group)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * k**0.5)
    ungrouped = fp8_grouped_linear_reference(x[:, :k], weight, scale, 1, block)  # every row on group 0's x
    assert not torch.allclose(got.float(), ungrouped.float(), rtol=tolerance, atol=tolerance * k**0.5)
    odd = random_fp8_weight(groups * (decode_config(block, rows).block_n + 16), k, block, generator, device)
    with pytest.raises(ValueError, match="column tile"):
        fp8_grouped_linear_triton(x, *odd, groups, block)


def test_fp8_grouped_linear_equals_the_reference():
    check_fp8_grouped_linear(rows=3, groups=4, n_group=128, k=200, dtype=torch.float32, seed=0)
    check_fp8_grouped_linear(rows=2, groups=2, n_group=64, k=96, dtype=torch.float32, seed=1, block=32)


def test_fp8_linear_pair_equals_two_references():
    check_fp8_linear_pair(rows=3, n1=128, n2=70, k=300, dtype=torch.float32, seed=0)
    check_fp8_linear_pair(rows=1, n1=64, n2=32, k=96, dtype=torch.float32, seed=1, block=32)


def check_fp8_linear_w8a8(rows: int, n: int, k: int, block: int, seed: int, device: str = DEVICE,
                          config: tuple[int, int, int, int, int] | None = None) -> None:
    """fp8 activations: within float32 summation order of fp8_linear_w8a8_reference (x rounded to e4m3
    per 1 x block group), and within e4m3's rounding (||d|| / ||y|| < 5e-2; ~2.5e-2 expected on randn)
    of the bf16 reference. K a multiple of the block, N and M not of the tiles."""
    from kernels.fp8_linear import (
        fp8_linear_reference,
        fp8_linear_w8a8,
        fp8_linear_w8a8_reference,
    )
    generator = torch.Generator(device).manual_seed(seed)
    weight, scale = random_fp8_weight(n, k, block, generator, device)
    x = (torch.randn(rows, k, generator=generator, device=device) * 3).bfloat16()
    got = fp8_linear_w8a8(x, weight, scale, block, config)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n) and bool(torch.isfinite(got).all())
    same_function = fp8_linear_w8a8_reference(x, weight, scale, block)
    torch.testing.assert_close(got.float(), same_function.float(), rtol=2e-2, atol=2e-2 * k**0.5)
    bf16 = fp8_linear_reference(x, weight, scale, block).float()
    assert float((got.float() - bf16).norm() / bf16.norm()) < 5e-2


def test_fp8_linear_kernel_equals_the_reference():
    check_fp8_linear(rows=3, n=70, k=200, dtype=torch.float32, seed=0)


def test_fp8_linear_kernel_splits_k_into_shares():
    """One decode row against a long K: the K shares' partial sums add up to the reference."""
    check_fp8_linear(rows=1, n=40, k=1000, dtype=torch.float32, seed=1)


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_split_k_configs_equal_the_reference(block):
    """The decode kernel's knobs: K steps a divisor, the size and a multiple of the scale block (two
    or four scales a row a step), one share (no partial sums: y stored by the kernel) or one K step a
    share, N off the column tile."""
    from kernels.fp8_linear import DecodeConfig

    for config in (DecodeConfig(16, block // 2, 1, 4, 2), DecodeConfig(32, 128, 10**6, 4, 3),
                   DecodeConfig(16, 4 * block if block == 32 else 256, 8, 4, 1)):
        check_fp8_linear(rows=2, n=40, k=700, dtype=torch.float32, seed=block, block=block, config=config)


def test_fp8_linear_last_share_adds_the_shares():
    """The split-K kernel's last program of a tile adds the K shares (arrival counters): bitwise the
    separate sum kernel's result, the counters back at zero after."""
    import kernels.fp8_linear as fp8
    from kernels.split_k import tile_counters

    generator = torch.Generator(DEVICE).manual_seed(11)
    weight, scale = random_fp8_weight(70, 700, 128, generator, DEVICE)
    x = torch.randn(3, 700, generator=generator, device=DEVICE)
    config = fp8.DecodeConfig(32, 128, 10**6, 4, 3)  # 3 x 6 tiles, 6 shares
    counted = fp8.fp8_linear_triton(x, weight, scale, 128, config)
    assert not bool(tile_counters(x.device, 1).any())
    assert torch.equal(counted, fp8.fp8_linear_triton(x, weight, scale, 128, config, last_sums=False))


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_tensor_core_tiles_equal_the_reference(block):
    """The prefill path's tiles (small here: the interpreter is slow), 128 x 128 and V4.1's 32 x 32 blocks."""
    check_fp8_linear(rows=21, n=70, k=300, dtype=torch.float32, seed=5, block=block, path="tc", config=(16, 32, 64, 4, 1))


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_fp8_activations_equal_their_reference(block):
    check_fp8_linear_w8a8(rows=19, n=70, k=256, block=block, seed=6, config=(16, 32, 128, 4, 1))


def check_fp8_dequant(n: int, k: int, block: int, seed: int, device: str = DEVICE, rows: int = 0) -> None:
    """The one-pass dequantization: bitwise dequantize_fp8_blocks(...).to(bf16), every e4m3 byte but NaN
    among the values; with `rows`, fp8_linear (the large-M dispatch) bitwise the reference too."""
    from kernels.fp8_linear import (
        dequantize_fp8_blocks_triton,
        fp8_linear,
        fp8_linear_reference,
    )
    from kernels.quant import dequantize_fp8_blocks

    generator = torch.Generator(device).manual_seed(seed)
    raw = torch.randint(0, 256, (n, k), generator=generator, device=device, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x11
    weight = raw.view(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block), -(-k // block), generator=generator, device=device) + 0.01
    # Triton's interpreter rounds float32 -> bf16 toward zero (the GPU to nearest even): bf16 on the GPU only
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        got = dequantize_fp8_blocks_triton(weight, scale, block, dtype)
        assert torch.equal(got, dequantize_fp8_blocks(weight, scale, block).to(dtype))
    if rows:
        x = torch.randn(rows, k, generator=generator, device=device).bfloat16()
        assert torch.equal(fp8_linear(x, weight, scale, block), fp8_linear_reference(x, weight, scale, block))


@pytest.mark.parametrize("block", [128, 32])
def test_fp8_dequant_kernel_is_bitwise_the_reference(block):
    check_fp8_dequant(n=70, k=300, block=block, seed=block)


def check_engram_gather(rows: int, dim: int, ids: int, seed: int, device: str = DEVICE) -> None:
    """fp8 tables with E8M0 (uint8) and float32 scales, every e4m3 byte but NaN among the values (e4m3
    subnormals included), row ids repeated and at both table edges: bitwise the reference."""
    from kernels.engram import gather_engram_rows_reference, gather_engram_rows_triton

    generator = torch.Generator(device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, dim), generator=generator, device=device, dtype=torch.uint8)
    values = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw).view(torch.float8_e4m3fn)
    row_ids = torch.randint(0, rows, (ids, 3), generator=generator, device=device)
    row_ids[0, 0], row_ids[-1, -1] = 0, rows - 1
    exponents = torch.randint(100, 140, (rows, dim // 32), generator=generator, device=device, dtype=torch.uint8)
    for scales in (exponents, torch.exp2(exponents.float() - 127)):
        got, want = gather_engram_rows_triton(values, scales, row_ids), gather_engram_rows_reference(values, scales, row_ids)
        assert got.shape == (ids, 3, dim) and torch.equal(got, want)


def test_engram_gather_kernel_is_bitwise_the_reference():
    check_engram_gather(rows=50, dim=96, ids=7, seed=0)


def random_fp8_weight(n: int, k: int, block: int, generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] weight block-quantized as released (e4m3 values, power-of-two block scales), on `device`."""
    from kernels.quant import quantize_fp8_blocks

    weight, scale = quantize_fp8_blocks(torch.randn(n, k, generator=generator, device=device).cpu(), block)
    return weight.to(device), scale.to(device)


def check_pool_decode(batch: int, dim: int, rope_half: int, rate: int, overlap: bool, dtype: torch.dtype, seed: int,
                      device: str = DEVICE) -> None:
    """The fused pooler step against the torch one: the rings bitwise (the same casts), the entries
    within one rounding step of the model dtype (sums in another order), and the paged store written
    exactly where a token closes its window, untouched elsewhere. Positions cover window 0 (no
    previous window), a window's last token and tokens mid-window; the slots are not in batch order."""
    from kernels.pooler import pool_decode_reference, pool_decode_triton
    from models.cache import paged_write_rows

    generator = torch.Generator(device).manual_seed(seed)
    width, ring, per_page, pages = (2 if overlap else 1) * dim, 2 * rate + 3, 2, 4 * batch

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device) * scale

    raw_kv, raw_gate = randn(batch + 2, ring, width).to(dtype), randn(batch + 2, ring, width, scale=2).to(dtype)
    # slots and positions as the decode graphs pass them: strided columns of one int64 input buffer
    inputs = torch.zeros(batch, 4, dtype=torch.long, device=device)
    slots, positions = inputs[:, 0], inputs[:, 1]
    slots.copy_(torch.randperm(batch + 2, generator=generator, device=device)[:batch])
    positions.copy_(torch.randint(0, 6 * rate, (batch,), generator=generator, device=device))
    positions[0], positions[1] = rate - 1, 3 * rate - 1  # window 0 closes; a later window closes
    kv, gate = randn(batch, width).to(dtype), randn(batch, width, scale=2).to(dtype)
    bias, weight = randn(rate, width), torch.rand(dim, generator=generator, device=device) + 0.5
    angles = torch.rand(batch, rope_half, generator=generator, device=device) * 6
    cos, sin = angles.cos() * 1.2, angles.sin() * 1.2
    tables = torch.randperm(pages, generator=generator, device=device).view(batch, 4).to(torch.int32)
    store = randn(pages, per_page, dim).to(dtype)
    ring_args = [t.clone() for t in (raw_kv, raw_gate)]
    rest = (slots, positions, kv, gate, bias, weight, 1e-6, cos, sin, rate, overlap)
    want = pool_decode_reference(*ring_args, *rest)
    want_store = store.clone()
    paged_write_rows(want_store, tables.long(), positions // rate, want, where=(positions + 1) % rate == 0)
    got = pool_decode_triton(raw_kv, raw_gate, *rest, store=store, tables=tables)
    assert torch.equal(raw_kv, ring_args[0]) and torch.equal(raw_gate, ring_args[1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(store, want_store, rtol=tolerance, atol=tolerance)
    untouched = torch.ones_like(store, dtype=torch.bool)
    closes = (positions + 1) % rate == 0
    for b in closes.nonzero().flatten().tolist():
        window = int(positions[b]) // rate
        untouched[int(tables[b, window // per_page]), window % per_page] = False
    assert torch.equal(store[untouched], want_store[untouched]) and (~untouched).any()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pairs_per_program", [32, 2])
def test_pool_decode_kernel_equals_the_reference(overlap, pairs_per_program, monkeypatch):
    """A window of 4 (one chunk of slots) and of 24 (the 16-slot chunks, the last partial); rope on
    part of the channels; the channels in one pooling program, or in blocks of 2 pairs (4 and 2 programs
    a sequence, their sums of squares added by the finishing kernel)."""
    monkeypatch.setattr("kernels.pooler.PAIRS_PER_PROGRAM", pairs_per_program)
    check_pool_decode(batch=5, dim=16, rope_half=4, rate=4, overlap=overlap, dtype=torch.float32, seed=0)
    check_pool_decode(batch=3, dim=8, rope_half=2, rate=24, overlap=overlap, dtype=torch.float32, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_pool_decode_kernel_compiled_equals_the_reference(seed):
    """V4-Flash's poolers, compiled: CSA (rate 4, overlap, 512 wide), its indexer (128 wide) and HCA
    (rate 128, 512 wide), rope on the last 64 channels, in bf16 as served and in float32."""
    for dtype in (torch.bfloat16, torch.float32):
        check_pool_decode(batch=33, dim=512, rope_half=32, rate=4, overlap=True, dtype=dtype, seed=seed, device="cuda")
        check_pool_decode(batch=33, dim=128, rope_half=32, rate=4, overlap=True, dtype=dtype, seed=seed, device="cuda")
        check_pool_decode(batch=9, dim=512, rope_half=32, rate=128, overlap=False, dtype=dtype, seed=seed, device="cuda")


def check_slot_lookup(capacity: int, rows: int, seed: int, device: str = DEVICE) -> None:
    """A device slot index after random inserts and evictions (tombstones, keys displaced from their
    homes): the kernel's slots and miss counts are the torch reference's, bitwise."""
    import numpy as np

    from engram_store.slot_index import MAX_PROBE, _MIX, DeviceSlotIndex
    from kernels.slot_lookup import slot_lookup_reference, slot_lookup_triton

    rng = np.random.default_rng(seed)
    index = DeviceSlotIndex(capacity, device)
    held = rng.choice(10 * capacity, size=capacity, replace=False)
    index.insert(held, rng.permutation(capacity))
    index.remove(held[: capacity // 3])
    asked = torch.from_numpy(np.concatenate([held, rng.integers(0, 10 * capacity, size=rows)])).to(device)
    asked = asked[torch.randperm(len(asked), generator=torch.Generator().manual_seed(seed)).to(device)].view(-1, 3)
    args = (index.device_keys, index.device_slots, index.bits, int(_MIX), MAX_PROBE + 1)
    counts = [torch.full((2,), 5, dtype=torch.int32, device=device) for _ in range(2)]
    got = slot_lookup_triton(asked, *args, counts[0], 1)
    want = slot_lookup_reference(asked, *args, counts[1], 1)
    assert torch.equal(got, want) and torch.equal(counts[0], counts[1])
    live = np.isin(asked.cpu().numpy(), held[capacity // 3 :])
    assert np.array_equal(want.cpu().numpy() >= 0, live) and int(counts[0][1]) == 5 + int((~live).sum())
    assert int(counts[0][0]) == 5


def test_slot_lookup_kernel_is_bitwise_the_reference():
    check_slot_lookup(capacity=300, rows=150, seed=0)


def check_count_hits(capacity: int, slots: int, seed: int, device: str = DEVICE) -> None:
    """Three calls of repeated slots: the kernel's credits and distinct-hit totals are the reference's
    (torch.unique), its stamps telling a call's first sight of a slot from the calls before."""
    from kernels.slot_lookup import count_hits_reference, count_hits_triton

    generator = torch.Generator(device).manual_seed(seed)
    stamps = torch.zeros(capacity, dtype=torch.int32, device=device)
    credits = [torch.zeros(capacity, dtype=torch.int32, device=device) for _ in range(2)]
    hits = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(2)]
    for call in range(1, 4):
        asked = torch.randint(0, capacity // 3 * call, (slots, 2), generator=generator, device=device)
        count_hits_triton(asked, stamps, credits[0], hits[0], call)
        count_hits_reference(asked, credits[1], hits[1])
        assert torch.equal(credits[0], credits[1]) and torch.equal(hits[0], hits[1]), call
    assert int(credits[0].max()) > 1 and int(hits[0]) < 3 * 2 * slots


def test_count_hits_kernel_equals_the_reference():
    check_count_hits(capacity=200, slots=90, seed=0)


def check_engram_hash(batch: int, seed: int, device: str = DEVICE) -> None:
    """A decode step's row ids hashed by the kernel and by the torch statement (NgramHasher's), for
    sequences at position 0, with dead look-backs and with full ones: the same ids and the same
    advanced look-backs, bitwise, in two layouts (2- and 3-grams, 4 heads; 2-grams only)."""
    import numpy as np

    from engram_store.hashing import DEAD, EngramLayout, NgramHasher
    from kernels.engram_hash import hash_decode_rows_triton

    rng = np.random.default_rng(seed)
    for max_ngram, heads in ((3, 4), (2, 3), (4, 2)):
        layout = EngramLayout.build([1, 4, 6], max_ngram, heads, 1000)
        hasher = NgramHasher(rng.integers(0, 700, size=900).tolist(), layout, pad_id=3)
        slots = torch.from_numpy(rng.permutation(batch + 3)[:batch]).to(device)
        tokens = torch.from_numpy(rng.integers(0, 900, size=batch)).to(device)
        positions = torch.from_numpy(rng.integers(0, 3, size=batch)).to(device)
        context = torch.from_numpy(rng.integers(0, 700, size=(batch + 3, max_ngram - 1))).to(device)
        context[slots[0]] = DEAD
        context[slots[1], 0] = DEAD
        expected_context = context.clone()
        want = hasher.step_row_ids_reference(slots, tokens, positions, expected_context)
        lookup, multipliers, primes, offsets = hasher._tensors(torch.device(device))
        got = hash_decode_rows_triton(slots, tokens, positions, context, lookup, multipliers, primes, offsets,
                                      hasher.pad, heads)
        assert torch.equal(got, want) and torch.equal(context, expected_context), (max_ngram, heads)


def test_engram_hash_kernel_is_bitwise_the_reference():
    check_engram_hash(batch=9, seed=0)


def check_masked_scores(n: int, heads: int, dim: int, total: int, first: int, dtype: torch.dtype, seed: int,
                        device: str = DEVICE) -> None:
    """The indexer's chunk scoring kernel against the torch path: half-precision queries and keys (their
    products exact in float32), float32 head weights, entries first .. first + total - 1 masked past each
    query's visible count (none visible, some, all). Sums run in another order: within 1e-5 of the
    scores' scale. Then the chunk's top-k through the kernel picks the torch path's ids wherever the k-th
    and (k+1)-th scores are apart by more than that."""
    from kernels.index_topk import indexer_topk, masked_scores_reference, masked_scores_triton, scoring_kernel_applies

    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=generator, device=device).to(dtype)
    keys = torch.randn(total, dim, generator=generator, device=device).to(dtype)
    weights = torch.rand(n, heads, generator=generator, device=device)
    visible = torch.randint(first, first + total + 2, (n,), generator=generator, device=device)
    visible[0], visible[1] = 0, first + total
    got = masked_scores_triton(q, weights, keys, visible, first)
    want = masked_scores_reference(q, weights, keys, visible, first)
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    seen = want > float("-inf")
    scale = want[seen].abs().max()
    torch.testing.assert_close(got[seen] / scale, want[seen] / scale, rtol=0, atol=1e-5)
    if first == 0 and scoring_kernel_applies(q, keys):
        k = 16
        ids = indexer_topk(q, weights, keys, visible, k, key_tile=total // 3).ids
        ordered = want.sort(dim=1, descending=True).values
        apart = (ordered[:, k - 1] - ordered[:, k]).abs() > 1e-4 * scale
        want_ids = indexer_topk(q.float(), weights, keys.float(), visible, k).ids  # the torch path (float32)
        assert torch.equal(ids[apart], want_ids[apart]) and apart.sum() > n // 2


def test_indexer_scores_kernel_equals_the_torch_path():
    # float16 stands for the half-precision dots here (the interpreter's bfloat16 dots are wrong)
    check_masked_scores(n=70, heads=3, dim=16, total=150, first=0, dtype=torch.float16, seed=0)
    check_masked_scores(n=9, heads=2, dim=32, total=40, first=25, dtype=torch.float16, seed=1)


def check_group_pool(batch: int, dim: int, rate: int, ring: int, seed: int, device: str = DEVICE) -> None:
    """V4.1's decode group pooling (ring write + per-channel softmax over the group's tokens) against the
    torch ops: rings of rate rows and with draft rows, positions anywhere in a group, slots and positions
    read from strided columns (a decode graph's input rows); the rings must end the same too."""
    from kernels.group_pool import group_pool_reference, group_pool_triton

    generator = torch.Generator(device).manual_seed(seed)
    raw_kv = torch.randn(batch + 2, ring, dim, generator=generator, device=device)
    raw_gate = torch.randn(batch + 2, ring, dim, generator=generator, device=device) * 3
    inputs = torch.stack([torch.randperm(batch + 2, generator=generator, device=device)[:batch],
                          torch.randint(0, 5 * rate, (batch,), generator=generator, device=device)], dim=1)
    slots, positions = inputs[:, 0], inputs[:, 1]
    kv = torch.randn(batch, dim, generator=generator, device=device)
    gate = torch.randn(batch, dim, generator=generator, device=device)
    rings = (raw_kv.clone(), raw_gate.clone())
    got = group_pool_triton(*rings, slots, positions, kv, gate, rate)
    want = group_pool_reference(raw_kv, raw_gate, slots, positions, kv, gate, rate)
    assert torch.equal(rings[0], raw_kv) and torch.equal(rings[1], raw_gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_group_pool_kernel_equals_the_reference():
    check_group_pool(batch=3, dim=80, rate=4, ring=4, seed=0)  # a partial channel block
    check_group_pool(batch=2, dim=64, rate=3, ring=6, seed=1)  # a rate padded to 4; draft rows in the ring
