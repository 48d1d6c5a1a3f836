"""RMS norm over the last dim, weighted (float32 weight, product cast back once) or unweighted (the
float32 scale cast to the input dtype first, as V4's q and mHC norms do).

In torch a norm is five or six kernels (cast, square, mean, rsqrt, multiplies); a decode layer runs
about ten norms, so on the GPU `rms_norm` runs each as one Triton kernel: one program per row, two
passes over the row in blocks (sum of squares, then scale). `rms_norm_reference` is the torch
definition (the CPU path and the test oracle).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
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


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = rows_in_place(x)  # rows may be strided (a column slice of a wider output, as fp8_linear_pair's)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # both forms cast back to the input dtype
    if rows.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(dim))
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if weight is None else weight, out, rows.stride(0), dim, eps,
                                           weight is not None, BLOCK=block)
    return out.view(x.shape)


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit column stride: a view where x allows it (a row-strided column slice
    is read in place by the kernels that take a row stride), a copy otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_stride, dim, eps, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
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
