"""RMS norm over the last dim, weighted (float32 weight, product cast back once) or unweighted (the
float32 scale cast to the input dtype first, as V4's q and mHC norms do).

In torch a norm is five or six kernels (cast, square, mean, rsqrt, multiplies); a decode layer runs
about ten norms, so on the GPU `rms_norm` runs each as one Triton kernel: one program per row, two
passes over the row in blocks (sum of squares, then scale). `rms_norm_reference` is the torch
definition (the CPU path and the test oracle).

`rms_norm_rope` is a norm whose output is then turned by RoPE in place (V4 attention's q heads and kv
row): the same program rotates the row it just normed (kernels/rope.py's `turn_rows_in_place` on the
rounded output), one launch where the two kernels were two, the same bits.
"""

from __future__ import annotations

import torch

from kernels.rope import apply_rope_

try:
    import triton
    import triton.language as tl

    from kernels.rope import turn_rows_in_place
except ImportError:  # CPU-only installs: the reference path runs
    triton = None

BLOCK = 1024


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if triton is None or not x.is_cuda:
        return rms_norm_reference(x, weight, eps)
    return rms_norm_triton(x, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """rope: (cos, sin) [tokens, R / 2] to turn each output row's last R channels by (x [tokens, heads,
    D] or [tokens, D]; R a power of two), as `rms_norm_rope`."""
    dim = x.shape[-1]
    rows = rows_in_place(x)  # rows may be strided (a column slice of a wider output, as fp8_linear_pair's)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # both forms cast back to the input dtype
    if rows.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(dim))
        cos, sin = (out, out) if rope is None else (rope[0].float().contiguous(), rope[1].float().contiguous())
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if weight is None else weight, out, cos, sin, rows.stride(0), dim,
                                           x.shape[1] if x.dim() == 3 else 1, eps, weight is not None,
                                           R=0 if rope is None else 2 * rope[0].shape[-1], BLOCK=block)
    return out.view(x.shape)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope_(rms_norm(x, weight, eps), cos, sin)`, one kernel on the GPU (x [tokens, heads, D] or
    [tokens, D], R = 2 * cos.shape[-1] a power of two). A tensor autograd tracks takes the two ops."""
    rope_dim = 2 * cos.shape[-1]
    if (triton is None or not x.is_cuda or rope_dim & (rope_dim - 1) or x.dim() not in (2, 3)
            or (x.requires_grad and torch.is_grad_enabled())):
        return apply_rope_(rms_norm(x, weight, eps), cos, sin)
    return rms_norm_triton(x, weight, eps, (cos, sin))


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit column stride: a view where x allows it (a row-strided column slice
    is read in place by the kernels that take a row stride), a copy otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, cos_ptr, sin_ptr, x_stride, dim, heads, eps, WEIGHTED: tl.constexpr,
                         R: tl.constexpr, BLOCK: tl.constexpr):
        """One row normed; R > 0: then its last R channels turned in place by RoPE (the row's token is
        row // heads), reading back the rounded output after a barrier."""
        eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
        row = tl.program_id(0).to(tl.int64)
        x_row, out_row = x_ptr + row * x_stride, out_ptr + row * dim
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, dim, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            value = tl.load(x_row + offsets, mask=offsets < dim, other=0.0).to(tl.float32)
            squares += value * value
        scale = tl.rsqrt(tl.sum(squares, axis=0) / dim + eps)
        for start in range(0, dim, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < dim
            value = tl.load(x_row + offsets, mask=inside, other=0.0)
            if WEIGHTED:
                weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0)
                normed = weight * (value.to(tl.float32) * scale)
            else:
                # torch's x * scale.to(x.dtype): the scale rounded to x's dtype, the product rounded once
                normed = value.to(tl.float32) * scale.to(value.dtype).to(tl.float32)
            tl.store(out_row + offsets, normed.to(out_ptr.dtype.element_ty), mask=inside)
        if R > 0:
            tl.debug_barrier()  # the whole row stored before its rotated channels are read back
            turn_rows_in_place(out_ptr, cos_ptr, sin_ptr, row + tl.arange(0, 1), tl.full([1], 1, tl.int1), heads, dim,
                               R, False)
