"""The accumulation clock: which micro-batch's backward completes an optimizer step.

One `AccumulationClock` per engine, shared with its strategy: the engine moves it (micro-batches,
`no_sync()`, `step()`, `set_gradient_accumulation_boundary`), the strategy asks it for the boundary of
a backward pass the engine did not start. Pure logic: no tensors, no process group.

[Note: the accumulation boundary]
Three sources decide whether a backward reduces and a step() applies the optimizer, first match wins:
  1. a forced boundary (`set_gradient_accumulation_boundary(True/False)`, what accelerate calls);
  2. `managed_gradient_accumulation: false`: the boundary is step() itself (the caller steps only when
     it wants an optimizer step; backwards outside step() accumulate);
  3. counting: micro-batch `micro_steps` ends a step when (micro_steps + 1) % gradient_accumulation_steps == 0.
A backward inside `no_sync()` never reduces, whatever the boundary says (`backward_boundary()`); the
step after it reduces what was accumulated (Strategy.finish_reduction).

Phases (ClockPhase) and their legal moves:
    ACCUMULATING --enter_no_sync--> NO_SYNC --leave_no_sync--> ACCUMULATING
    ACCUMULATING --begin_step-----> STEPPING --end_step-----> ACCUMULATING (micro_steps + 1)
Any other move is a broken invariant: AssertionError naming the rank and both phases. (step() inside
no_sync() is the user's error: the engine refuses it with a RuntimeError before moving the clock.)
"""

from __future__ import annotations

import enum
from contextlib import contextmanager
from typing import Iterator


class ClockPhase(enum.Enum):
    """Where the engine's loop is, as far as the accumulation boundary cares."""

    ACCUMULATING = "accumulating"  # outside no_sync() and step(): forwards and backwards of micro-batches
    NO_SYNC = "no_sync"  # inside engine.no_sync(): backwards accumulate without communicating
    STEPPING = "stepping"  # inside engine.step(): the boundary when accumulation is not managed


class AccumulationClock:
    """Micro-batch count, no_sync, forced boundaries and the plain `loss.backward()` passes of one engine.

    `gradient_accumulation_steps`: micro-batches per optimizer step (default 1). `managed`: the config's
    `managed_gradient_accumulation` (default True: count micro-batches). `rank`: named in errors.
    """

    def __init__(self, gradient_accumulation_steps: int = 1, managed: bool = True, rank: int = 0) -> None:
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.managed = managed
        self.rank = rank
        self.phase = ClockPhase.ACCUMULATING
        self.micro_steps = 0  # step() calls completed: DeepSpeed's engine.micro_steps, saved in checkpoints
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary; None: the rule decides
        self.implicit_backwards = 0  # backward passes a gradient hook opened (plain loss.backward()) since zero_grad
        self.scaled_losses = 0  # engine.scale(loss) calls since zero_grad: plain backwards that carry the loss scale

    # --- the boundary ---------------------------------------------------------------------------

    def is_boundary(self) -> bool:
        """True on the micro-batch whose backward completes an optimizer step ([Note: the accumulation
        boundary])."""
        if self.boundary_override is not None:
            return self.boundary_override
        if not self.managed:
            return self.phase is ClockPhase.STEPPING
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward_boundary(self) -> bool:
        """The boundary a backward pass starting now runs with: `is_boundary()`, but never inside no_sync()."""
        return self.is_boundary() and self.phase is not ClockPhase.NO_SYNC

    def force_boundary(self, is_boundary: bool | None) -> None:
        """Force the boundary on or off; None: back to the rule ([Note: the accumulation boundary])."""
        self.boundary_override = is_boundary

    # --- phases ---------------------------------------------------------------------------------

    @property
    def in_no_sync(self) -> bool:
        """Whether the engine is inside no_sync()."""
        return self.phase is ClockPhase.NO_SYNC

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """ACCUMULATING -> NO_SYNC for the block; a nested block leaves the outer one in charge."""
        if self.phase is ClockPhase.NO_SYNC:
            yield
            return
        self._move(ClockPhase.ACCUMULATING, ClockPhase.NO_SYNC)
        try:
            yield
        finally:
            self._move(ClockPhase.NO_SYNC, ClockPhase.ACCUMULATING)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """ACCUMULATING -> STEPPING for the block; a block that completes counts one micro-batch."""
        self._move(ClockPhase.ACCUMULATING, ClockPhase.STEPPING)
        try:
            yield
        finally:
            self._move(ClockPhase.STEPPING, ClockPhase.ACCUMULATING)
        self.micro_steps += 1

    def _move(self, expected: ClockPhase, new: ClockPhase) -> None:
        if self.phase is not expected:
            raise AssertionError(f"rank {self.rank}: accumulation clock moving {self.phase.name} -> {new.name}, "
                                 f"legal only from {expected.name}")
        self.phase = new

    # --- passes the engine did not start --------------------------------------------------------

    def count_implicit_backward(self) -> None:
        """A gradient hook opened a backward pass engine.backward did not (Strategy.entering_backward_hook)."""
        self.implicit_backwards += 1

    def count_scaled_loss(self) -> None:
        """engine.scale(loss) was called: one plain backward may carry the loss scale."""
        self.scaled_losses += 1

    def unscaled_implicit_backwards(self) -> bool:
        """Whether more plain backwards ran since zero_grad than losses were scaled (fp16 refuses to step)."""
        return self.implicit_backwards > self.scaled_losses

    def restart(self) -> None:
        """Gradients were zeroed: the next optimizer step's plain backwards are counted afresh."""
        self.implicit_backwards = self.scaled_losses = 0
