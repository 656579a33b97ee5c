"""Wall-clock timers: DeepSpeed's `wall_clock_breakdown` phases, and the step breakdown
(`engine.step_report()`: [Note: the step breakdown])."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

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
    the first (which pays for warm-up: allocator growth, first-touch, lazy initialisation), and the
    epoch / micro-step counters DeepSpeed's timer keeps (DeepSpeed-Chat calls `update_epoch_count()`
    at the end of each epoch)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size  # samples per optimizer step (train_batch_size)
        self.global_step_count = 0
        self.epoch_count = 0  # update_epoch_count() calls
        self.micro_step_count = 0  # engine.step() calls since the epoch began
        self._first_end: float | None = None  # when the first step ended
        self._last_end: float | None = None

    def update_epoch_count(self) -> None:
        """Count an epoch as finished: the epoch counter goes up and the micro-step counter restarts."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def micro_step_finished(self) -> None:
        """Called by the engine at the end of each engine.step() (a micro-batch, boundary or not)."""
        self.micro_step_count += 1

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
# Where one optimizer step's seconds go. The engine marks its phases (forward, backward, the boundary
# step) with `StepClock.phase`; inside them the layers below mark what the work waits on with
# `waiting(part)`: the comm layer every collective call and every wait on an async one
# ("communication": zerodp/comm/lifecycle.py's naming_lost_peers wraps both), offload its copies between host and
# device ("offload") and the swap pipeline its waits on the disk ("nvme"). A phase's own work is its
# time minus those waits (forward and backward compute; the optimizer step); the time outside the
# engine's calls is the input's (the data loader, and the user's code between the calls).
# Communication not waited for is hidden behind compute: an async collective's flight runs from its
# launch to the end of its wait, and the time some flight was under way while the work was not
# waiting on communication is the overlapped communication. That is an upper bound (a collective may
# finish before it is waited for; nothing reports when it does). Waits nest once: a collective inside
# an offload copy counts as the copy's.
#
# Every time is a span between two marks of one clock. On the CPU a mark is the host's clock. On CUDA
# it is an event recorded on the current stream, the one stream zerodp queues its compute, copies and
# waits on (NCCL's streams start a collective after what was queued before it and the current stream
# waits for its end), so a span is the time the device took to get from one mark to the other: a
# phase's kernels however far ahead the host ran, a wait's stall of the stream, nothing for a host
# wait (on the disk) the device had queued work to hide. The events are resolved when the step ends,
# which waits for the device to finish the step (the loss the metrics read waits for most of it anyway).

Mark = Any
"""A point on a StepClock: a host perf_counter() value, or a CUDA event recorded on the current stream."""

_active: list["StepClock"] = []
"""The clocks whose phase is running, innermost last (an engine's forward may run inside another's)."""


class StepClock:
    """The seconds of the optimizer step in progress, by phase and by what the work waited on,
    on the host's clock or, for a CUDA `device`, on the device's ([Note: the step breakdown])."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.on_device = device is not None and device.type == "cuda"
        self.device = device
        self.phase_name: str | None = None
        self._depth = 0  # waits in progress (an inner one is part of the outer)
        self._start: Mark | None = None  # where the step in progress began: the last one's end, or its first forward
        self.reset()

    def mark(self) -> Mark:
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the engine's device, whichever is current
        return event

    def reset(self) -> None:
        self.spans: dict[tuple[str, str], list[tuple[Mark, Mark]]] = defaultdict(list)  # (phase, "total" | part)
        self.bytes: dict[str, int] = defaultdict(int)  # moved by the waits of a part (offload copies)
        self.flights: list[tuple[Mark, Mark]] = []  # async collectives, launch to the end of their wait

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        outer, start = self.phase_name, self.mark()
        if self._start is None:  # the first step begins at its first phase
            self._start = start
        self.phase_name = name
        _active.append(self)
        try:
            yield
        finally:
            _active.pop()
            self.phase_name = outer
            self.spans[(name, "total")].append((start, self.mark()))

    def _seconds_since(self, start: Mark) -> Callable[[Mark], float]:
        """Seconds from `start` to a mark (negative before it), once the device has reached them."""
        if not self.on_device:
            return lambda mark: mark - start

        def seconds(mark: Mark) -> float:
            mark.synchronize()
            return start.elapsed_time(mark) / 1e3  # milliseconds

        return seconds

    def take(self, offloaded_optimizer: bool) -> dict:
        """The breakdown of the step that ends now, then reset; the next step begins here."""
        end = self.mark()
        start, self._start = (self._start if self._start is not None else end), end
        at = self._seconds_since(start)
        wall = max(at(end), 0.0)
        spans = {key: [(max(at(a), 0.0), at(b)) for a, b in marks] for key, marks in self.spans.items()}
        s = {key: sum(b - a for a, b in intervals) for key, intervals in spans.items()}
        waits = {part: sum((v for (_, p), v in s.items() if p == part), 0.0) for part in ("communication", "offload", "nvme")}
        own = {phase: s.get((phase, "total"), 0.0) - sum(s.get((phase, part), 0.0) for part in waits)
               for phase in ("forward", "backward", "step")}
        inside = sum(s.get((phase, "total"), 0.0) for phase in ("forward", "backward", "step"))
        blocked = [span for (_, part), intervals in spans.items() if part == "communication" for span in intervals]
        flights = [(max(at(a), 0.0), at(b)) for a, b in self.flights]
        overlapped = max(_union(flights + blocked) - _union(blocked), 0.0)
        report = {
            "seconds": wall,
            "clock": "cuda-events" if self.on_device else "host",
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
            "nvme_wait_in_step": s.get(("step", "nvme"), 0.0),
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
    """Time the work waits on `part` ("communication", "offload", "nvme") inside the running phase,
    and the `num_bytes` the wait moves (offload copies count theirs: the step report's offload_bytes)."""
    clock = _active[-1] if _active else None
    if clock is None or clock._depth:
        yield
        return
    clock._depth += 1
    start = clock.mark()
    try:
        yield
    finally:
        clock._depth -= 1
        clock.spans[(clock.phase_name, part)].append((start, clock.mark()))
        clock.bytes[part] += num_bytes


def launched() -> tuple[StepClock, Mark] | None:
    """Where an async collective launched now begins its flight (None outside a phase)."""
    return (_active[-1], _active[-1].mark()) if _active else None


def in_flight(launch: tuple[StepClock, Mark] | None) -> None:
    """The async collective `launch` (launched()) was waited for until now."""
    if launch is not None and _active and _active[-1] is launch[0]:
        launch[0].flights.append((launch[1], launch[0].mark()))


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of `intervals`."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
