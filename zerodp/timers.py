"""Wall-clock timers for the step breakdown (DeepSpeed's `wall_clock_breakdown` names)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class Timers:
    """Named accumulating timers: `with timers("fwd"): ...`; `timers.take()` returns and resets.

    With `synchronize` (CUDA and `wall_clock_breakdown` on) each stop waits for the device, so a
    time covers the kernels it launched; that costs overlap, so it is off by default.
    """

    def __init__(self, synchronize: bool = False) -> None:
        self.synchronize = synchronize
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.totals[name] += self._now() - start

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    def take(self) -> dict[str, float]:
        """Seconds per timer since the last take, then reset."""
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals
