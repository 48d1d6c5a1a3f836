"""Engram table store (V4.1): file format, residency tiers, io_uring prefetch. Built by the Engram issue."""
