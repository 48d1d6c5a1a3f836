"""Arrival counters for split-K kernels whose last share adds the shares.

A split-K kernel cuts a GEMM's K into shares run by different programs; their float32 partial sums
must then be added in a fixed order (a result must not depend on timing: graph replays equal eager
runs bitwise). A second kernel can add them, but at decode sizes its launch costs as much as the
sum. Instead each program stores its partial sums and increments its output tile's counter (acq_rel,
GPU scope); the program that sees the count reach `shares` adds all shares in share order, writes
the result and sets the counter back to zero. The counters live here, one zeroed int32 buffer per
device, so that kernels/fp8_linear.py and kernels/moe_mxfp4.py share it: their launches run one
after another on one stream, and each leaves every counter at zero.
"""

from __future__ import annotations

import torch

# output tiles one launch may count (32 rows x 262,144 columns in tiles of 16 x 64)
MAX_COUNTED_TILES = 8192

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """MAX_COUNTED_TILES int32 zeros on `device`, or None where the launch cannot count: more than
    MAX_COUNTED_TILES tiles, or a graph being captured before the counters exist (an allocation there
    would live in the graph's pool). None: the caller adds the shares in a second kernel."""
    if tiles > MAX_COUNTED_TILES:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTED_TILES, dtype=torch.int32, device=device)
    return counters
