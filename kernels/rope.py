"""Interleaved (GPT-J) RoPE on the trailing channels of each row, as DeepSeek-V4 applies it.

x is [N, D] or [N, heads, D]; cos / sin are [N, R / 2] float32 (R rotated channels, the last R of D).
Pairs (2i, 2i + 1) of the rotated part turn by angle i of their row's position, in float32, and are
cast back; the first D - R channels pass through. In torch that is ~10 kernels (cast, strided
slices, stack, cat) and a decode layer applies it five to seven times, so on the GPU `apply_rope`
is one Triton program per row (one head of one token). `apply_rope_reference` is the torch
definition (the CPU path and the oracle). `apply_rope_` turns a tensor nobody else reads in place: only
its R rotated channels are read and written (V4's attention rows: 64 of 512), where `apply_rope` reads
every channel twice and writes a copy of all of them (`inverse=True` turns back, for the attention output,
without a negated copy of sin).

`rope_table` makes the cos / sin rows themselves: angle i of a position is position x inv_freq[i] in float32,
times the spec's attention factor; with `rate`, the position is first rounded down to a multiple of it (a
compressed entry's position). In torch that is six kernels (cast, product, cos, scale, sin, scale) and
two more for the rounding, for each of a decode step's four or five tables; on the GPU it is one.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pass -sin for the inverse rotation."""
    dim = x.shape[-1]
    if triton is None or not x.is_cuda or dim & (dim - 1):
        return apply_rope_reference(x, cos, sin)
    return apply_rope_triton(x, cos, sin)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` written into x (returned): its last R channels turned where they lie, the rest
    untouched; the same bits. For tensors no one else reads (a projection's or norm's fresh output). A
    tensor autograd tracks (training, tools/train_tiny.py) gets `apply_rope`'s new tensor instead.
    inverse: turned back (`apply_rope` with -sin), the same bits as that."""
    if x.requires_grad and torch.is_grad_enabled():
        return apply_rope(x, cos, -sin if inverse else sin)
    rope_dim = 2 * cos.shape[-1]
    if triton is None or not x.is_cuda or not x.is_contiguous() or rope_dim & (rope_dim - 1):
        x[..., -rope_dim:] = apply_rope_reference(x[..., -rope_dim:], cos, -sin if inverse else sin)
        return x
    return apply_rope_triton_(x, cos, sin, inverse)


def apply_rope_triton_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x contiguous, R a power of two."""
    rope_dim = 2 * cos.shape[-1]
    dim, heads = x.shape[-1], x.shape[1] if x.dim() == 3 else 1
    rows = x.numel() // dim
    if rows:
        _rope_in_place_kernel[(triton.cdiv(rows, IN_PLACE_ROWS),)](
            x, cos.float().contiguous(), sin.float().contiguous(), rows, heads, dim, R=rope_dim, ROWS=IN_PLACE_ROWS,
            INVERSE=inverse, num_warps=1,
        )
    return x


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, rate: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] (integers), inv_freq [R / 2] float32 on their device -> (cos, sin) [N, R / 2] float32 of
    (positions // rate * rate) x inv_freq, times scale. One kernel on the GPU (see the module docstring)."""
    if triton is None or not positions.is_cuda:
        return rope_table_reference(positions, inv_freq, scale, rate)
    return rope_table_triton(positions, inv_freq, scale, rate)


def rope_table_reference(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                         rate: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    if rate != 1:
        positions = positions // rate * rate
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * scale, freqs.sin() * scale


TABLE_ROWS = 16  # positions a program of the table kernel computes


def rope_table_triton(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                      rate: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(n, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        _rope_table_kernel[(triton.cdiv(n, TABLE_ROWS),)](  # positions may be strided (a decode graph's input column)
            positions, inv_freq, cos, sin, n, positions.stride(0), half, float(scale), rate, ROWS=TABLE_ROWS,
            HALF=triton.next_power_of_2(half), num_warps=1,
        )
    return cos, sin


IN_PLACE_ROWS = 16  # rows (heads of tokens) a program of the in-place kernel turns


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim, half = x.shape[-1], cos.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1 or rows.stride(0) != dim:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rope_kernel[(rows.shape[0],)](
            rows, cos.float().contiguous(), sin.float().contiguous(), out, heads, half, D=dim
        )
    return out.view(x.shape)


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, half, D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        token = row // heads
        channel = tl.arange(0, D)
        value = tl.load(x_ptr + row * D + channel)
        partner = tl.load(x_ptr + row * D + (channel ^ 1)).to(tl.float32)  # the other half of the pair
        rotated_index = channel - (D - 2 * half)
        in_rope = rotated_index >= 0
        angle = tl.where(in_rope, rotated_index // 2, 0)
        c = tl.load(cos_ptr + token * half + angle, mask=in_rope, other=1.0)
        s = tl.load(sin_ptr + token * half + angle, mask=in_rope, other=0.0)
        sign = tl.where(channel % 2 == 0, -1.0, 1.0)
        turned = tl.fma(value.to(tl.float32), c, sign * partner * s)  # one fma, as the in-place kernel
        out = tl.where(in_rope, turned.to(value.dtype), value)
        tl.store(out_ptr + row * D + channel, out)

    @triton.jit
    def _rope_in_place_kernel(x_ptr, cos_ptr, sin_ptr, rows, heads, dim, R: tl.constexpr, ROWS: tl.constexpr,
                              INVERSE: tl.constexpr):
        """Rows [program x ROWS, + ROWS): their last R channels turned in place (`turn_rows_in_place`)."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        turn_rows_in_place(x_ptr, cos_ptr, sin_ptr, row, row < rows, heads, dim, R, INVERSE)

    @triton.jit
    def turn_rows_in_place(x_ptr, cos_ptr, sin_ptr, row, live, heads, dim, R: tl.constexpr, INVERSE: tl.constexpr):
        """Rows `row` (int64 [ROWS]; `live` [ROWS]: in range) of x [rows, dim]: their last R channels
        turned in place by their token's angles (row // heads), `_rope_kernel`'s arithmetic (an explicit
        fma in both: left to the compiler, the two kernels contracted the sum differently and differed by
        a bf16 ulp at 128 channels on the H200); INVERSE: by -sin (exact). A barrier between the loads
        and the stores: no lane overwrites a partner channel another lane has yet to read. The in-place
        kernel and kernels/norm.py's norm-then-rope kernel share it, so the two give the same bits."""
        live = live[:, None]
        channel = tl.arange(0, R)
        offsets = row[:, None] * dim + (dim - R) + channel[None, :]
        value = tl.load(x_ptr + offsets, mask=live, other=0.0)
        partner = tl.load(x_ptr + row[:, None] * dim + (dim - R) + (channel ^ 1)[None, :], mask=live,
                          other=0.0).to(tl.float32)
        angle = (row // heads)[:, None] * (R // 2) + (channel // 2)[None, :]
        c = tl.load(cos_ptr + angle, mask=live, other=1.0)
        s = tl.load(sin_ptr + angle, mask=live, other=0.0)
        if INVERSE:
            s = -s
        sign = tl.where(channel % 2 == 0, -1.0, 1.0)[None, :]
        turned = tl.fma(value.to(tl.float32), c, sign * partner * s).to(value.dtype)
        tl.debug_barrier()
        tl.store(x_ptr + offsets, turned, mask=live)

    @triton.jit(do_not_specialize=["n", "rate"])
    def _rope_table_kernel(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, n, position_stride, half, scale, rate,
                           ROWS: tl.constexpr, HALF: tl.constexpr):
        """Positions [program x ROWS, + ROWS): `rope_table_reference`'s float32 operations in its order
        (tl.cos / tl.sin are libdevice's accurate cosf / sinf, as torch's)."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, HALF)
        live = row < n
        position = tl.load(positions_ptr + row * position_stride, mask=live, other=0)
        rounded = position // rate * rate  # C's division truncates: floor it for negative positions as torch does
        position = tl.where(rounded > position, rounded - rate, rounded)
        inv = tl.load(inv_freq_ptr + column, mask=column < half, other=0.0)
        freqs = position.to(tl.float32)[:, None] * inv[None, :]
        inside = live[:, None] & (column < half)[None, :]
        offsets = row[:, None] * half + column[None, :]
        tl.store(cos_ptr + offsets, tl.cos(freqs) * scale, mask=inside)
        tl.store(sin_ptr + offsets, tl.sin(freqs) * scale, mask=inside)
