"""Host memory a GPU kernel reads and writes in place: a shared-memory mapping (memfd), pinned and
mapped into the device's address space, seen as a CPU tensor and as a device tensor over the same
bytes.

Both the KV host tier (models/host_tier.py) and the Engram host row cache (engram_store/cache.py)
keep data in RAM that decode steps need a few scattered rows of. Copying those rows to the GPU takes a
host gather, a staging buffer and a transfer the host must order; with the memory mapped, the gather
kernel itself reads the rows over the bus (zero-copy), inside a CUDA graph if need be, and the CPU
side still writes the bytes with plain memory copies.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass

import torch

CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass(frozen=True)
class HostBytes:
    host: torch.Tensor  # uint8 [n] on the CPU
    device: torch.Tensor  # the same bytes as a tensor of the compute device (`host` itself off CUDA)


class _MappedHostMemory:
    """Registered host memory seen as device memory (UVA: the device address is the host address);
    torch.as_tensor reads `__cuda_array_interface__` and keeps this object (and the mapping) alive.
    When the device tensor goes, the range is unregistered before the mapping can be unmapped: a
    registration left behind would make the driver refuse whatever the kernel maps there next
    ("resource already mapped")."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.__cuda_array_interface__ = {
            "shape": (host.numel(),), "typestr": "|u1", "data": (host.data_ptr(), False), "version": 3,
        }
        weakref.finalize(self, _unregister, host, device)  # holds `host` (the mapping) until then


def _unregister(host: torch.Tensor, device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # no kernel still reads or writes the range
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def mapped_host_bytes(nbytes: int, device: torch.device | str) -> HostBytes:
    """`nbytes` zeroed bytes in a shared-memory mapping (memfd). On a CUDA `device` the pages are pinned
    and also seen as a device tensor: kernels read and write them directly."""
    fd = os.memfd_create("ds4serve-host-bytes", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mapping = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    host = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
    device = torch.device(device)
    if device.type != "cuda" or nbytes == 0:
        return HostBytes(host, host)
    with torch.cuda.device(device):
        error = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed ({error}): lower the host"
                           " memory asked for (memory.host_memory_gb, engram.host_cache_gb) or raise the"
                           " locked-memory limit (ulimit -l)")
    return HostBytes(host, torch.as_tensor(_MappedHostMemory(host, device), device=device))
