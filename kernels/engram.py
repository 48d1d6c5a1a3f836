"""Engram row gather with dequantization (torch reference).

Table rows are float8_e4m3fn values with one E8M0 (power-of-two) scale per 32 channels; a row and
its scales are read together, so gathering and dequantizing are one op. Float tables (as a float32
reference checkpoint stores them) come with one unit scale per row and gather the same way.
"""

import torch

from kernels.quant import _as_float_scales


def gather_engram_rows(values: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """values [rows, dim] (fp8 or float), scales [rows, dim/block] -> float32 [*row_ids.shape, dim]."""
    flat = row_ids.reshape(-1)
    rows = values[flat].to(torch.float32)
    block = values.shape[-1] // scales.shape[-1]
    row_scales = _as_float_scales(scales[flat]).repeat_interleave(block, dim=-1)
    return (rows * row_scales).view(*row_ids.shape, values.shape[-1])
