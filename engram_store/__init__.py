"""Engram table store (V4.1): where table rows come from, and which rows a token looks up.

The model hashes a step's tokens (hashing.py), asks a `RowSource` to `start` the step's reads and gets
an `EngramStep` back, then reads each layer's rows through it. The in-memory table serves them from
RAM; the store (store.py) serves each layer from its residency's tier (gpu, host, or disk through
io_uring with row caches), opened by build.py from the RESIDENCIES registry.
"""

from engram_store.rows import EngramStep, InMemoryEngramTable, RowSource

__all__ = ["EngramStep", "InMemoryEngramTable", "RowSource"]
