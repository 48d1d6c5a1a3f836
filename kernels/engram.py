"""Engram row gather with dequantization: a torch reference and a Triton kernel.

Table rows are float8_e4m3fn values with one E8M0 (power-of-two) scale per 32 channels; a row and
its scales are read together, so gathering and dequantizing are one op. Float tables (as a float32
reference checkpoint stores them) come with one unit scale per row and gather the same way.
On the GPU an fp8 table is gathered by one kernel (one program per row id: the row's bytes decoded
from their bits, times the scale built from its exponent), instead of the reference's five ops and
their temporaries; both give the same bits (a value times a power of two is exact in float32).
"""

import torch

from kernels.quant import _as_float_scales

try:
    import triton
    import triton.language as tl

    from kernels.quant import _e4m3_to_float, _e8m0_to_float
except ImportError:  # CPU-only installs: the reference path runs
    triton = None


def gather_engram_rows(values: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """values [rows, dim] (fp8 or float), scales [rows, dim/block] -> float32 [*row_ids.shape, dim]:
    the kernel for fp8 tables on the GPU, the reference otherwise."""
    kernel_fits = values.dtype == torch.float8_e4m3fn and scales.dtype in (torch.uint8, torch.float32)
    if triton is not None and values.is_cuda and kernel_fits:
        return gather_engram_rows_triton(values, scales, row_ids)
    return gather_engram_rows_reference(values, scales, row_ids)


def gather_engram_rows_reference(values: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    flat = row_ids.reshape(-1)
    rows = values[flat].to(torch.float32)
    block = values.shape[-1] // scales.shape[-1]
    row_scales = _as_float_scales(scales[flat]).repeat_interleave(block, dim=-1)
    return (rows * row_scales).view(*row_ids.shape, values.shape[-1])


def gather_engram_rows_triton(values: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """Row-major tables whose rows may be strided (a row cache's [rows, value bytes | scale bytes])."""
    dim, n_scales = values.shape[-1], scales.shape[-1]
    if values.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("the gather kernel reads rows whose elements are contiguous")
    flat = row_ids.reshape(-1).contiguous()
    out = torch.empty(flat.shape[0], dim, dtype=torch.float32, device=values.device)
    if flat.shape[0]:
        _gather_kernel[(flat.shape[0],)](
            flat, values.view(torch.uint8), scales, out, dim, n_scales, dim // n_scales, values.stride(0),
            scales.stride(0), E8M0=scales.dtype == torch.uint8, DIM=triton.next_power_of_2(dim),
        )
    return out.view(*row_ids.shape, dim)


if triton is not None:

    @triton.jit
    def _gather_kernel(ids_ptr, values_ptr, scales_ptr, out_ptr, dim, n_scales, block, value_stride, scale_stride,
                       E8M0: tl.constexpr, DIM: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(ids_ptr + i).to(tl.int64)
        cols = tl.arange(0, DIM)
        inside = cols < dim
        value = _e4m3_to_float(tl.load(values_ptr + row * value_stride + cols, mask=inside, other=0).to(tl.int32))
        if E8M0:
            exponent = tl.load(scales_ptr + row * scale_stride + cols // block, mask=inside, other=127).to(tl.int32)
            scale = _e8m0_to_float(exponent)
        else:
            scale = tl.load(scales_ptr + row * scale_stride + cols // block, mask=inside, other=1.0)
        tl.store(out_ptr + i * dim + cols, value * scale, mask=inside)
