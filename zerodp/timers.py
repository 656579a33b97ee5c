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


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: training samples per second over the optimizer steps after
    the first (which pays for warm-up: allocator growth, first-touch, lazy initialisation)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size  # samples per optimizer step (train_batch_size)
        self.global_step_count = 0
        self._first_end: float | None = None  # when the first step ended
        self._last_end: float | None = None

    def step_finished(self) -> None:
        """Called by the engine at the end of each optimizer step."""
        now = time.perf_counter()
        self.global_step_count += 1
        self._first_end = now if self._first_end is None else self._first_end
        self._last_end = now

    @property
    def total_elapsed_time(self) -> float:
        """Seconds from the end of the first step to the end of the last."""
        return (self._last_end - self._first_end) if self._first_end is not None else 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second after the first step; -inf before two steps have ended (DeepSpeed's value)."""
        if self.global_step_count < 2 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * (self.global_step_count - 1) / self.total_elapsed_time
