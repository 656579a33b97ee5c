"""Wall-clock timers: DeepSpeed's `wall_clock_breakdown` phases, and the step breakdown
(`engine.step_report()`: [Note: the step breakdown])."""

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


# [Note: the step breakdown]
# Where one optimizer step's seconds go, on the host's clock. The engine marks its phases (forward,
# backward, the boundary step) with `StepClock.phase`; inside them the layers below mark the time
# the host spends waiting with `waiting(part)`: the comm layer every collective call and every wait
# on an async one ("communication": comm.py's _naming_lost_peers wraps both), offload its copies
# between host and device ("offload") and the swap pipeline its waits on the disk ("nvme"). A
# phase's own work is its time minus those waits (forward and backward compute; the optimizer step);
# the time outside the engine's calls is the input's (the data loader, and the user's code between
# the calls). Communication not waited for is hidden behind compute: an async collective's flight runs
# from its launch to the end of its wait, and the time some flight was under way while the host was
# not waiting on communication is the overlapped communication. That is an upper bound (a collective
# may finish before it is waited for; none reports when it does on the host's clock). Waits nest once:
# a collective inside an offload copy counts as the copy's. On CUDA these are host times: kernels and
# NCCL run asynchronously, so without synchronisation (wall_clock_breakdown synchronises each
# phase) the compute shows up wherever the host next waits for the device.

_active: list["StepClock"] = []
"""The clocks whose phase is running, innermost last (an engine's forward may run inside another's)."""


class StepClock:
    """The seconds of the optimizer step in progress, by phase and by what the host waited on."""

    def __init__(self) -> None:
        self.phase_name: str | None = None
        self._depth = 0  # waits in progress (an inner one is part of the outer)
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)  # (phase, "total" | part)
        self.bytes: dict[str, int] = defaultdict(int)  # moved by the waits of a part (offload copies)
        self.blocked: list[tuple[float, float]] = []  # waits on communication
        self.flights: list[tuple[float, float]] = []  # async collectives, launch to the end of their wait

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        outer, start = self.phase_name, time.perf_counter()
        self.phase_name = name
        _active.append(self)
        try:
            yield
        finally:
            _active.pop()
            self.phase_name = outer
            self.seconds[(name, "total")] += time.perf_counter() - start

    def take(self, wall: float, offloaded_optimizer: bool) -> dict:
        """The finished step's breakdown (`wall` seconds from the end of the previous step), then reset."""
        s = self.seconds
        waits = {part: sum((v for (_, p), v in s.items() if p == part), 0.0) for part in ("communication", "offload", "nvme")}
        own = {phase: s[(phase, "total")] - sum(s[(phase, part)] for part in waits) for phase in ("forward", "backward", "step")}
        inside = sum(s[(phase, "total")] for phase in ("forward", "backward", "step"))
        blocked = _union(self.blocked)
        overlapped = max(_union(self.flights + self.blocked) - blocked, 0.0)
        report = {
            "seconds": wall,
            "forward": own["forward"],
            "backward": own["backward"],
            "communication_exposed": waits["communication"],
            "communication_overlapped": overlapped,
            "optimizer": own["step"],
            "optimizer_on": "host" if offloaded_optimizer else "device",
            "offload_transfers": waits["offload"],
            "nvme_wait": waits["nvme"],
            "input": max(wall - inside, 0.0),
            "offload_bytes": self.bytes["offload"],
            "nvme_wait_in_step": s[("step", "nvme")],
        }
        parts = {
            "compute": report["forward"] + report["backward"] + (0.0 if offloaded_optimizer else report["optimizer"]),
            "communication": report["communication_exposed"],
            "offload": report["offload_transfers"] + report["nvme_wait"] + (report["optimizer"] if offloaded_optimizer else 0.0),
            "input": report["input"],
        }
        bound = max(parts, key=parts.get)
        comm = report["communication_exposed"] + overlapped
        report.update(parts_seconds=parts, verdict=f"{bound}-bound", share=parts[bound] / wall if wall > 0 else 0.0,
                      overlap_ratio=overlapped / comm if comm > 0 else None)
        self.reset()
        return report


@contextmanager
def waiting(part: str, num_bytes: int = 0) -> Iterator[None]:
    """Time the host waits on `part` ("communication", "offload", "nvme") inside the running phase,
    and the `num_bytes` the wait moves (offload copies count theirs: the step report's offload_bytes)."""
    clock = _active[-1] if _active else None
    if clock is None or clock._depth:
        yield
        return
    clock._depth += 1
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        clock._depth -= 1
        clock.seconds[(clock.phase_name, part)] += end - start
        clock.bytes[part] += num_bytes
        if part == "communication":
            clock.blocked.append((start, end))


def in_flight(launched: float) -> None:
    """An async collective launched at `launched` was waited for until now."""
    if _active:
        _active[-1].flights.append((launched, time.perf_counter()))


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of `intervals`."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
