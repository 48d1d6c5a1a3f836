"""The mixes of a manifold-constrained hyper-connection site, from its projected logits.

Per token, the site's linear map gives (2 + n) * n logits: n for `pre` (sigmoid + eps), n for `post`
(2 * sigmoid), n * n for `comb` (row softmax + eps, then Sinkhorn-Knopp: a column normalisation and
`iters - 1` row-then-column rounds, making it doubly stochastic). All of it is a few dozen numbers per
token, but in torch it is ~130 kernel launches per site (each Sinkhorn round is four), which made the
mHC sites most of a decode step's kernels. `hc_mixes` runs it as one Triton program per token on the
GPU; `hc_mixes_reference` is the plain torch definition (the CPU path and the test oracle).

A whole site is fused too, since at decode the site's torch ops around the mixes (the float32 cast of
the streams, the RMS norm, the (2 + n) * n x n * D projection, the collapse's product, sum and cast,
and the merge's casts, product, n x n matmul and sum) were ~12 more launches per site, ~100 per
4-layer step: `hc_site` is two kernels (a split-K pass of the projection and the sum of squares,
then one program per token for the norm, the mixes and the collapse, and where the caller gives it the
sublayer's input RMS norm too, `InputNorm`) and `hc_merge` one (the new streams from the sublayer
output). `hc_site_reference` / `hc_merge_reference` are the torch
definitions (the model's own ops: models/hyper.py calls these).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None


def hc_mixes_reference(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, (2 + n) * n] float32 -> (pre [T, n], post [T, n], comb [T, n, n]), float32."""
    pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_mixes(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mixes_reference`, as one Triton kernel where it can run (CUDA, n a power of two)."""
    if triton is None or not logits.is_cuda or n & (n - 1):
        return hc_mixes_reference(logits, base, scale, n, iters, hc_eps)
    return hc_mixes_triton(logits, base, scale, n, iters, hc_eps)


def hc_mixes_triton(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    logits = logits.contiguous()
    pre = torch.empty(tokens, n, dtype=torch.float32, device=logits.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=logits.device)
    if tokens:
        _hc_mixes_kernel[(tokens,)](
            logits, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, hc_eps, iters, n
        )
    return pre, post, comb


if triton is not None:

    @triton.jit
    def _mixes(pre_l, post_l, comb_l, base_ptr, scale_ptr, hc_eps, iters, N: tl.constexpr):
        """hc_mixes_reference on one token's logits (pre [N], post [N], comb [N, N], comb[j, k] at
        logit 2N + j * N + k): both kernels below run this one body, so they agree bit for bit."""
        i = tl.arange(0, N)
        square = i[:, None] * N + i[None, :]
        pre = tl.sigmoid(pre_l * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
        post = 2 * tl.sigmoid(post_l * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i))
        comb = comb_l * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + square)
        comb = tl.exp(comb - tl.max(comb, axis=1)[:, None])
        comb = comb / tl.sum(comb, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        return pre, post, comb

    @triton.jit
    def _hc_mixes_kernel(logits_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, iters, N: tl.constexpr):
        hc_eps = tl.cast(hc_eps, tl.float32)  # Inductor passes Python floats as fp64
        token = tl.program_id(0)
        row = logits_ptr + token * (2 + N) * N
        i = tl.arange(0, N)
        square = i[:, None] * N + i[None, :]
        pre, post, comb = _mixes(tl.load(row + i), tl.load(row + N + i), tl.load(row + 2 * N + square), base_ptr,
                                 scale_ptr, hc_eps, iters, N)
        tl.store(pre_ptr + token * N + i, pre)
        tl.store(post_ptr + token * N + i, post)
        tl.store(comb_ptr + token * N * N + square, comb)


# programs per token sharing the site projection's n * D reduction, and the columns each reads per
# iteration: measured on the H200 (bench.slice families), 128 x 128 was no faster at batch 1 (~11 us a
# site either way: the per-token finish, Sinkhorn's 20 dependent rounds, bounds it) and 12% slower at 32
SITE_SPLITS = 32
SITE_BLOCK = 512
MERGE_BLOCK = 1024  # hidden channels per merge program
# From this many tokens (prefill chunks) the projection runs in tiles of PROJECT_TILE_TOKENS tokens: the
# per-token kernel reads the site's whole float32 map (1.5 MB on V4-Flash) once per token, which made it
# ~0.6 ms a site on a 2,048-token chunk (an 8K prefill's third-largest cost on the H200). Same splits, so
# the finish kernel is shared; decode batches below it keep the per-token kernel measured for them.
PROJECT_TILE_MIN_TOKENS = 64
PROJECT_TILE_TOKENS = 64
PROJECT_TILE_BLOCK = 64
# The finish kernel's programs a step aims at: a decode step of few tokens splits each token's collapse
# into runs of MERGE_BLOCK channels, one program each (every program repeats the token's mixes, a few
# dozen dependent float32 rounds on n x n values, and the input norm's sum of squares over the whole
# row), so the n x D collapse is read by several SMs at once instead of one (at one token one program
# did Sinkhorn and the whole 4 x 4096 collapse: ~8.6 us a site on the H200, twentieth session's profile).
FINISH_PROGRAMS = 128


def finish_parts(tokens: int, dim: int) -> int:
    """Programs a token's finish takes: as many MERGE_BLOCK runs of its channels as keep the step's
    programs near FINISH_PROGRAMS (1 from FINISH_PROGRAMS / 2 tokens on)."""
    return max(1, min(-(-dim // MERGE_BLOCK), FINISH_PROGRAMS // max(tokens, 1)))


class InputNorm(NamedTuple):
    """The sublayer's input RMS norm (float32 weight [D], eps), which a site may apply to its collapse:
    the sublayer input then comes out of the site's last kernel, one launch fewer a site."""

    weight: torch.Tensor
    eps: float


def hc_site_reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
    hc_eps: float, norm_eps: float, collapse_pre: torch.Tensor | None = None, input_norm: InputNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] -> (pre [T, n], post [T, n], comb [T, n, n], collapsed [T, D] in the streams'
    dtype). The mixes come from the RMS-normed (unweighted) flattened streams in float32; the streams
    collapse with `collapse_pre` when given (V4.1: the previous site's pre), else with this site's pre;
    with `input_norm` the collapse comes back through that norm (kernels/norm.py's, as the model's
    RMSNorm applies it to the collapse)."""
    flat = streams.flatten(1).float()
    normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = hc_mixes(F.linear(normed, fn.float()), base, scale, n, iters, hc_eps)
    collapsed = hc_collapse(pre if collapse_pre is None else collapse_pre, streams)
    if input_norm is not None:
        collapsed = rms_norm_reference(collapsed, input_norm.weight, input_norm.eps)
    return pre, post, comb, collapsed


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_k pre[k] * streams[k] in float32, cast back to the stream dtype: the sublayer input."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_merge_reference(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """new[k] = post[k] * out + sum_j comb[j, k] * streams[j], in the streams' dtype as transformers
    computes it (the product and the n x n matmul each rounded to it, then their sum)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def _fusable(streams: torch.Tensor, n: int) -> bool:
    return triton is not None and streams.is_cuda and not n & (n - 1) and streams.shape[0] > 0


def hc_site(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
    hc_eps: float, norm_eps: float, collapse_pre: torch.Tensor | None = None, input_norm: InputNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_site_reference`, as two Triton kernels on CUDA (n a power of two)."""
    if not _fusable(streams, n):
        return hc_site_reference(streams, fn, base, scale, n, iters, hc_eps, norm_eps, collapse_pre, input_norm)
    return hc_site_triton(streams, fn, base, scale, n, iters, hc_eps, norm_eps, collapse_pre, input_norm)


def hc_merge(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`hc_merge_reference`, as one Triton kernel on CUDA (n a power of two)."""
    if not _fusable(streams, streams.shape[1]):
        return hc_merge_reference(streams, post, comb, out)
    return hc_merge_triton(streams, post, comb, out)


def hc_site_triton(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
    hc_eps: float, norm_eps: float, collapse_pre: torch.Tensor | None = None, input_norm: InputNorm | None = None,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`parts`: programs a token's finish takes (None: `finish_parts`); the same bits at any count."""
    tokens, _, dim = streams.shape
    streams = streams.contiguous()
    width = n * dim
    device = streams.device
    partial = torch.empty(tokens, SITE_SPLITS, (2 + n) * n + 1, dtype=torch.float32, device=device)
    fn = fn.float().contiguous()
    if tokens >= PROJECT_TILE_MIN_TOKENS:
        per_split = -(-width // (SITE_SPLITS * PROJECT_TILE_BLOCK)) * PROJECT_TILE_BLOCK
        _hc_project_tiles_kernel[(triton.cdiv(tokens, PROJECT_TILE_TOKENS), SITE_SPLITS)](
            streams, fn, partial, tokens, width, per_split, N=n,
            OUTPUTS=max(16, triton.next_power_of_2((2 + n) * n)), BLOCK_T=PROJECT_TILE_TOKENS,
            BLOCK=PROJECT_TILE_BLOCK, num_warps=4,
        )
    else:
        per_split = -(-width // (SITE_SPLITS * SITE_BLOCK)) * SITE_BLOCK
        _hc_project_kernel[(tokens, SITE_SPLITS)](
            streams, fn, partial, width, per_split, N=n, BLOCK=SITE_BLOCK, num_warps=8
        )
    pre = torch.empty(tokens, n, dtype=torch.float32, device=device)
    post, comb = torch.empty_like(pre), torch.empty(tokens, n, n, dtype=torch.float32, device=device)
    collapsed = torch.empty(tokens, dim, dtype=streams.dtype, device=device)
    own = collapse_pre is None
    given = pre if own else collapse_pre.float().contiguous()
    weight = pre if input_norm is None else input_norm.weight.float().contiguous()
    parts = parts or finish_parts(tokens, dim)
    per_part = -(-dim // (parts * MERGE_BLOCK)) * MERGE_BLOCK  # channels a program collapses
    _hc_finish_kernel[(tokens, -(-dim // per_part))](
        partial, base.float().contiguous(), scale.float().contiguous(), streams, given, pre, post, comb, collapsed,
        weight, width, dim, per_part, norm_eps, hc_eps, 0.0 if input_norm is None else input_norm.eps, iters, N=n,
        SPLITS=SITE_SPLITS, OWN_PRE=own, INPUT_NORM=input_norm is not None, BLOCK=MERGE_BLOCK, num_warps=4,
    )
    return pre, post, comb, collapsed


def hc_merge_triton(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    tokens, n, dim = streams.shape
    streams, out = streams.contiguous(), out.contiguous()
    merged = torch.empty_like(streams)
    _hc_merge_kernel[(tokens, triton.cdiv(dim, MERGE_BLOCK))](
        streams, post.float().contiguous(), comb.float().contiguous(), out, merged, dim, N=n, BLOCK=MERGE_BLOCK,
        num_warps=4,
    )
    return merged


if triton is not None:

    @triton.jit
    def _hc_project_kernel(streams_ptr, fn_ptr, partial_ptr, width, per_split, N: tl.constexpr, BLOCK: tl.constexpr):
        """partial[t, s] = (fn @ x[slice s], sum of x[slice s]^2) for x = the token's flattened streams:
        rows [0, N) of fn are pre's, [N, 2N) post's, [2N, 2N + N * N) comb's."""
        token, split = tl.program_id(0), tl.program_id(1)
        row = streams_ptr + token.to(tl.int64) * width
        i = tl.arange(0, N)
        j = tl.arange(0, N * N)
        squares = tl.zeros([BLOCK], tl.float32)
        acc_pre = tl.zeros([N, BLOCK], tl.float32)
        acc_post = tl.zeros([N, BLOCK], tl.float32)
        acc_comb = tl.zeros([N * N, BLOCK], tl.float32)
        begin = split * per_split
        for offset in range(0, per_split, BLOCK):
            k = begin + offset + tl.arange(0, BLOCK)
            inside = k < width
            x = tl.load(row + k, mask=inside, other=0.0).to(tl.float32)
            squares += x * x
            acc_pre += tl.load(fn_ptr + i[:, None] * width + k[None, :], mask=inside[None, :], other=0.0) * x[None, :]
            acc_post += tl.load(fn_ptr + (N + i[:, None]) * width + k[None, :], mask=inside[None, :], other=0.0) * x[None, :]
            acc_comb += tl.load(fn_ptr + (2 * N + j[:, None]) * width + k[None, :], mask=inside[None, :], other=0.0) * x[None, :]
        out = partial_ptr + (token * tl.num_programs(1) + split) * ((2 + N) * N + 1)
        tl.store(out + i, tl.sum(acc_pre, axis=1))
        tl.store(out + N + i, tl.sum(acc_post, axis=1))
        tl.store(out + 2 * N + j, tl.sum(acc_comb, axis=1))
        tl.store(out + (2 + N) * N, tl.sum(squares, axis=0))

    @triton.jit
    def _hc_project_tiles_kernel(streams_ptr, fn_ptr, partial_ptr, tokens, width, per_split, N: tl.constexpr,
                                 OUTPUTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
        """`_hc_project_kernel`'s partial sums for BLOCK_T tokens at once: each tile of the map is read
        once for them all, the products as one float32 dot on the tensor cores in TF32 x 3 (each
        operand split in a TF32 head and tail, three TF32 products): within ~2^-21 of each float32
        product, where an IEEE float32 dot (CUDA-core FMAs) took 0.33 ms a site on a 2,048-token chunk
        on the H200; the map's (2 + N) * N rows padded to OUTPUTS columns."""
        block, split = tl.program_id(0), tl.program_id(1)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        live = t < tokens
        c = tl.arange(0, OUTPUTS)
        used = c < (2 + N) * N
        squares = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, OUTPUTS], tl.float32)
        begin = split * per_split
        for offset in range(0, per_split, BLOCK):
            k = begin + offset + tl.arange(0, BLOCK)
            inside = k < width
            x = tl.load(streams_ptr + t[:, None].to(tl.int64) * width + k[None, :],
                        mask=live[:, None] & inside[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
            fn = tl.load(fn_ptr + c[None, :] * width + k[:, None], mask=used[None, :] & inside[:, None], other=0.0)
            acc = tl.dot(x, fn, acc, input_precision="tf32x3")
        out = partial_ptr + (t * tl.num_programs(1) + split) * ((2 + N) * N + 1)
        tl.store(out[:, None] + c[None, :], acc, mask=live[:, None] & used[None, :])
        tl.store(out + (2 + N) * N, squares, mask=live)

    @triton.jit
    def _collapse_block(base_row, weights, start, dim, N: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr):
        """Channels [start, start + BLOCK) of sum_k weights[k] * streams[k] in float32, rounded to `dtype`
        (0 past dim), and which of them exist."""
        i = tl.arange(0, N)
        d = start + tl.arange(0, BLOCK)
        inside = d < dim
        x = tl.load(base_row + i[:, None] * dim + d[None, :], mask=inside[None, :], other=0.0).to(tl.float32)
        return tl.sum(weights[:, None] * x, axis=0).to(dtype), d, inside

    @triton.jit
    def _hc_finish_kernel(partial_ptr, base_ptr, scale_ptr, streams_ptr, given_ptr, pre_ptr, post_ptr, comb_ptr,
                          collapsed_ptr, weight_ptr, width, dim, per_part, norm_eps, hc_eps, input_eps, iters,
                          N: tl.constexpr, SPLITS: tl.constexpr, OWN_PRE: tl.constexpr, INPUT_NORM: tl.constexpr,
                          BLOCK: tl.constexpr):
        """Program (token, part): the splits summed, the norm's scale applied, the mixes (`_mixes`; part 0
        stores them), then channels [part x per_part, + per_part) of the collapse with this site's pre
        (OWN_PRE) or the given one; with INPUT_NORM the collapse through kernels/norm.py's weighted RMS
        norm (weight_ptr, input_eps), as `_rms_norm_kernel` computes it from the rounded collapse: a pass
        over the whole row for its sum of squares, then the part's channels again, scaled. Every part
        computes the same mixes and sum in the same order: the bits do not depend on the part count."""
        norm_eps = tl.cast(norm_eps, tl.float32)  # Inductor passes Python floats as fp64
        hc_eps = tl.cast(hc_eps, tl.float32)
        input_eps = tl.cast(input_eps, tl.float32)
        token = tl.program_id(0)
        stride = (2 + N) * N + 1
        rows = partial_ptr + token * SPLITS * stride + tl.arange(0, SPLITS)[:, None] * stride
        i = tl.arange(0, N)
        square = i[:, None] * N + i[None, :]  # comb[j, k] at logit 2N + j * N + k
        squares = tl.sum(tl.load(rows + (2 + N) * N), axis=0)
        inv = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / width + norm_eps)
        pre_l = tl.sum(tl.load(rows + i[None, :]), axis=0) * inv
        post_l = tl.sum(tl.load(rows + N + i[None, :]), axis=0) * inv
        flat = tl.arange(0, N * N)
        comb_l = tl.reshape(tl.sum(tl.load(rows + 2 * N + flat[None, :]), axis=0) * inv, (N, N))
        pre, post, comb = _mixes(pre_l, post_l, comb_l, base_ptr, scale_ptr, hc_eps, iters, N)
        first = tl.program_id(1) * per_part
        if first == 0:
            tl.store(pre_ptr + token * N + i, pre)
            tl.store(post_ptr + token * N + i, post)
            tl.store(comb_ptr + token * N * N + square, comb)
        last = tl.minimum(first + per_part, dim)
        if OWN_PRE:
            weights = pre
        else:
            weights = tl.load(given_ptr + token * N + i)
        base_row = streams_ptr + token.to(tl.int64) * width
        out_row = collapsed_ptr + token.to(tl.int64) * dim
        dtype: tl.constexpr = collapsed_ptr.dtype.element_ty
        if INPUT_NORM:
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, dim, BLOCK):
                value, _, _ = _collapse_block(base_row, weights, start, dim, N, BLOCK, dtype)
                squares += value.to(tl.float32) * value.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / dim + input_eps)
            for start in range(first, last, BLOCK):
                value, d, inside = _collapse_block(base_row, weights, start, dim, N, BLOCK, dtype)
                weight = tl.load(weight_ptr + d, mask=inside, other=0.0)
                tl.store(out_row + d, (weight * (value.to(tl.float32) * inv_rms)).to(dtype), mask=inside)
        else:
            for start in range(first, last, BLOCK):
                value, d, inside = _collapse_block(base_row, weights, start, dim, N, BLOCK, dtype)
                tl.store(out_row + d, value, mask=inside)

    @triton.jit
    def _hc_merge_kernel(streams_ptr, post_ptr, comb_ptr, out_ptr, merged_ptr, dim, N: tl.constexpr,
                         BLOCK: tl.constexpr):
        """new[k, d] = round(round(post[k]) * out[d]) + round(sum_j round(comb[j, k]) * streams[j, d]),
        each round to the streams' dtype, as hc_merge_reference's ops round."""
        token, block = tl.program_id(0), tl.program_id(1)
        dtype = merged_ptr.dtype.element_ty
        i = tl.arange(0, N)
        d = block * BLOCK + tl.arange(0, BLOCK)
        inside = d < dim
        row = token.to(tl.int64) * N * dim
        x = tl.load(streams_ptr + row + i[:, None] * dim + d[None, :], mask=inside[None, :], other=0.0).to(tl.float32)
        out = tl.load(out_ptr + token.to(tl.int64) * dim + d, mask=inside, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + token * N + i).to(dtype).to(tl.float32)
        spread = (post[:, None] * out[None, :]).to(dtype).to(tl.float32)
        for k in tl.static_range(N):
            weights = tl.load(comb_ptr + token * N * N + i * N + k).to(dtype).to(tl.float32)  # comb[:, k]
            mixed = tl.sum(weights[:, None] * x, axis=0).to(dtype).to(tl.float32)
            spread_k = tl.sum(tl.where(i[:, None] == k, spread, 0.0), axis=0)
            tl.store(merged_ptr + row + k * dim + d, (spread_k + mixed).to(dtype), mask=inside)
