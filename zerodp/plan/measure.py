"""The peak of a real run's live tensor bytes on the CPU, from the allocator's own accounting.

    with AllocatorTrace() as trace:
        model = build()                      # allocations from here on are counted
        engine, *_ = zerodp.initialize(...)
        trace.mark("train")
        ...train...
    trace.peak_since("train")                # the most bytes live at once after the mark

This is the estimator's independent check (bench/estimate_accuracy.py, tests/test_simulate.py): the
simulation (zerodp/plan/simulate.py) counts storages as torch's dispatcher creates them on fake
tensors; this counts what c10's CPU allocator actually hands out and takes back while the real run
executes, as torch's profiler records it (`profile_memory=True`: one event per allocation and free,
storage resizes included, with its byte count), so kernel-internal temporaries that never pass
through Python dispatch are in it too. Allocations made before the trace starts are not; what gloo
or the C library allocate outside c10 is not either. On CUDA use `torch.cuda.max_memory_allocated`.
Inside the trace zerodp's collectives are settled (`comm.settled_collectives`): each returns once
gloo's thread has let go of its tensors, so the figures do not depend on that thread's timing.
"""

from __future__ import annotations

import gc
from contextlib import ExitStack
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from zerodp import comm
from zerodp.plan.engines import EngineFactory, build_engine
from zerodp.plan.simulate import train_steps

_MARK = "zerodp.measure.mark:"


class AllocatorTrace:
    """Every CPU allocation and free between enter and exit, with named marks in between."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._events: list[tuple[int, int]] = []  # (start ns, +bytes allocated / -bytes freed)
        self._marks: dict[str, int] = {}
        self._stack = ExitStack()

    def __enter__(self) -> "AllocatorTrace":
        with ExitStack() as stack:  # unwinds what entered when the profiler cannot start
            stack.enter_context(comm.settled_collectives())
            stack.enter_context(self._profile)
            self._stack = stack.pop_all()
        return self

    def mark(self, name: str) -> None:
        """A point in time `peak_since(name)` counts from (after collecting garbage, so tensors in
        reference cycles that are already unreachable do not count)."""
        gc.collect()
        with record_function(_MARK + name):
            pass

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)
        for event in self._profile.profiler.kineto_results.events():
            if event.name() == "[memory]":
                self._events.append((event.start_ns(), event.nbytes()))
            elif event.name().startswith(_MARK):
                self._marks[event.name()[len(_MARK):]] = event.start_ns()
        self._events.sort()

    def live_at(self, name: str) -> int:
        """Bytes live (allocated inside the trace and not yet freed) at the mark."""
        return sum(delta for start, delta in self._events if start <= self._marks[name])

    def peak_since(self, name: str) -> int:
        """The most bytes live at once (allocated inside the trace) from the mark to the end."""
        when, live, peak = self._marks[name], 0, None
        for start, delta in self._events:
            if start > when and peak is None:
                peak = live  # what was live at the mark
            live += delta
            if peak is not None:
                peak = max(peak, live)
        return live if peak is None else peak


def measure_training(build: Any, config: dict, batch: Any, steps: int = 2, prepare: Any = None,
                     initialize: EngineFactory | None = None) -> tuple[int, dict]:
    """The real counterpart of zerodp.plan.simulate.simulate_training, on this rank of the process
    group that exists: (the peak of live bytes over `steps` optimizer steps after initialize, from
    the allocator, and the engine's ledger `held`). Same arguments as simulate_training's."""
    with AllocatorTrace() as trace:
        model = build()
        if prepare is not None:
            prepare(model)
        engine = build_engine(initialize, model=model, config=config)
        del model
        comm.drain_pending()  # gloo's threads let go of initialize's tensors when they get to it
        trace.mark("train")
        train_steps(engine, batch, steps)
    return trace.peak_since("train"), engine.memory_report()["held"]
