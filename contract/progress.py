"""Progress a person can watch through the long steps of a start: weight loading, Engram table conversion.

On a terminal with text logs it is a tqdm bar on stderr (bytes done, rate, time left). Where a redrawn
bar would be noise (stderr is a file or a container's log, or the process logs JSON) it is a log line at
most every LOG_EVERY_S with the same numbers, so a long start still shows it is moving. Each process
(the engine, every tensor-parallel rank) decides for itself from the logging it configured
(contract/logs.py). tqdm is imported only when a bar is drawn: the engine's spawn target imports
contract/ with the standard library alone.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Self

from contract.logs import JsonFormatter

LOG_EVERY_S = 30.0
GiB = 2**30


def _terminal_with_text_logs() -> bool:
    json_logs = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return sys.stderr.isatty() and not json_logs


class Progress:
    """Counts bytes done out of `total` (None when unknown: no percentage or time left)."""

    def __init__(self, description: str, total: int | None, log: logging.Logger, enabled: bool = True) -> None:
        self.description, self.total, self._log = description, total, log
        self.done = 0
        self._started = self._logged = time.monotonic()
        self._enabled = enabled
        self._bar = None
        if enabled and _terminal_with_text_logs():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, amount: int) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
        elif self._enabled and time.monotonic() - self._logged >= LOG_EVERY_S:
            self._logged = time.monotonic()
            self._log.info("%s: %s", self.description, self.describe())

    def describe(self) -> str:
        """'12.3 of 35.0 GiB (35%), 1.2 GiB/s, about 20 s left'; without a total, what is done and the rate."""
        rate = self.done / max(time.monotonic() - self._started, 1e-9)
        if not self.total:
            return f"{self.done / GiB:.1f} GiB, {rate / GiB:.2f} GiB/s"
        left = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
        return (f"{self.done / GiB:.1f} of {self.total / GiB:.1f} GiB ({100 * self.done // self.total}%), "
                f"{rate / GiB:.2f} GiB/s, about {left:.0f} s left")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
