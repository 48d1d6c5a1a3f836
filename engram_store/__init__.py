"""Engram table store (V4.1): where table rows come from.

The model asks a `RowSource` for the rows of a step; the in-memory table serves them from RAM.
The NVMe tiers with io_uring prefetch (issue 6) implement the same interface.
"""

from engram_store.rows import InMemoryEngramTable, RowSource

__all__ = ["InMemoryEngramTable", "RowSource"]
