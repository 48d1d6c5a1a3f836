"""Host -> device copies that never make the host wait for the device.

A blocking host-to-device copy (what `torch.tensor(values, device="cuda")` and `tensor.to("cuda")` do)
synchronizes the stream: the host waits for every kernel queued before it. With overlapped scheduling
the host plans step N+1 while step N runs, so one such copy in the plan's inputs would make the host
wait for step N after all. These copies stage the values in pinned memory (torch's caching host
allocator, which keeps a block until the copies that read it have run) and copy without blocking, in
stream order. On the CPU they are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def on_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the device."""
    return moved(torch.tensor(values, dtype=dtype), device)


def moved(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device` without waiting for the device (the tensor itself when already there)."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
