"""Ops with a plain torch reference (the CPU path) and, where it pays, a GPU path beside it."""

from kernels.engram import gather_engram_rows
from kernels.fake_quant import fake_quant_fp4_e4m3, fake_quant_fp4_ue8m0, fake_quant_fp8_ue8m0
from kernels.quant import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8_blocks, quantize_mxfp4
from kernels.topk import stable_topk

__all__ = [
    "fake_quant_fp4_e4m3",
    "fake_quant_fp4_ue8m0",
    "fake_quant_fp8_ue8m0",
    "gather_engram_rows", "dequantize_fp8_blocks", "dequantize_mxfp4", "quantize_fp8_blocks", "quantize_mxfp4", "stable_topk"]
