"""The plumbing of CUDA C++ kernels in this project and the device code that feeds `mma.m16n8k16` from
registers: compiling by NVRTC through CuPy (the `gpu` extra), launching on torch's stream in the right
device's context, the activations' operand loads.

The operand mapping (kernels/mma_layout.py lays MXFP4 weights out for it): the m16n8k16 sum runs over
k, so which column a k stands for is free as long as both operands agree; lane t's k of k-block kb in a
128-column chunk stand for columns 32 t + 4 kb + {0, 1} (registers a0 / b0) and + {2, 3} (a2 / b1). A
lane then reads one run of 32 columns a chunk, in 16-byte loads (`load_a` for the activations). Used by
kernels/moe_mxfp4_mma.py; an FP8 linear on the same mapping (e4m3 rows need no layout at all) measured
no faster than the Triton split-K kernel at decode shapes (BENCHMARKS.md, eighteenth session).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

import torch

CHUNK = 128  # columns of one K step: a run of 32 for each of the 4 lanes of an mma row group
TILE_ROWS = 8  # output rows of one mma tile (the B operand's n)
WARPS = 4  # a CTA's warps (128 threads)

DEVICE_SOURCE = r"""
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A operands of chunk c's 8 k-blocks for lane t: rows g (row0) and g + 8 (row1) of the block,
// columns 32 t + 4 kb + {0, 1} (a0, a1) and + {2, 3} (a2, a3), i.e. the lane's run of 32 columns in
// four 16-byte loads a row (a null row: a row the block does not have, zeros).
__device__ __forceinline__ void load_a(unsigned (&a)[8][4], const uint4* row0, const uint4* row1, int c, int t) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int o = c * 16 + t * 4 + q;
        const uint4 u0 = row0 ? __ldg(row0 + o) : make_uint4(0u, 0u, 0u, 0u);
        const uint4 u1 = row1 ? __ldg(row1 + o) : make_uint4(0u, 0u, 0u, 0u);
        a[2 * q][0] = u0.x;
        a[2 * q][2] = u0.y;
        a[2 * q + 1][0] = u0.z;
        a[2 * q + 1][2] = u0.w;
        a[2 * q][1] = u1.x;
        a[2 * q][3] = u1.y;
        a[2 * q + 1][1] = u1.z;
        a[2 * q + 1][3] = u1.w;
    }
}

// Two floats -> bf16x2 (round to nearest even), lo in the low half.
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
"""


@cache
def cupy_importable() -> bool:
    return importlib.util.find_spec("cupy") is not None


def runs_on(device: torch.device) -> bool:
    """Whether the CUDA kernels run on `device`: CUDA, compute capability 9.0 or later, CuPy importable."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and cupy_importable()


@cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_index(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


@cache
def compiled(source: str, name: str, options: tuple[str, ...], device: int) -> Any:
    """`name` from `source` compiled by NVRTC with `options`, loaded on `device`, once a process; call it
    through `launch` (inside that device's context)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=DEVICE_SOURCE + source, options=("-std=c++17", *options)).get_function(name)


def launch(function: Any, grid: tuple[int, ...], args: tuple[Any, ...], device: int) -> None:
    """Runs `function` on torch's current stream of `device`, in that device's context (CuPy's current
    device is its own, not torch's: a tensor-parallel rank's is not device 0)."""
    import cupy

    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        function(grid, (32 * WARPS,), args)
