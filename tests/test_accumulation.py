"""The accumulation clock (zerodp/accumulation.py) and the strategy's backward pass states: pure logic."""

from __future__ import annotations

import pytest

from zerodp import comm
from zerodp.accumulation import AccumulationClock, ClockPhase
from zerodp.zero.base import BackwardPass, Strategy


def _boundaries(clock: AccumulationClock, micro_batches: int) -> list[bool]:
    seen = []
    for _ in range(micro_batches):
        seen.append(clock.backward_boundary())
        with clock.stepping():
            pass
    return seen


def test_counting_marks_every_nth_micro_batch_and_step_counts_it() -> None:
    clock = AccumulationClock(gradient_accumulation_steps=3)
    assert _boundaries(clock, 6) == [False, False, True, False, False, True]
    assert clock.micro_steps == 6 and clock.phase is ClockPhase.ACCUMULATING


def test_a_forced_boundary_wins_until_cleared() -> None:
    clock = AccumulationClock(gradient_accumulation_steps=4)
    clock.force_boundary(True)
    assert clock.is_boundary()
    clock.force_boundary(False)
    assert not clock.is_boundary()
    clock.force_boundary(None)
    assert not clock.is_boundary()  # micro-batch 0 of 4


def test_unmanaged_accumulation_has_its_boundary_inside_step_only() -> None:
    clock = AccumulationClock(gradient_accumulation_steps=2, managed=False)
    assert not clock.is_boundary()
    with clock.stepping():
        assert clock.is_boundary()
    assert not clock.is_boundary()


def test_no_sync_never_reduces_and_nests() -> None:
    clock = AccumulationClock(gradient_accumulation_steps=1)
    with clock.no_sync():
        with clock.no_sync():
            assert clock.in_no_sync
        assert clock.is_boundary() and not clock.backward_boundary()  # the outer block still holds
    assert clock.backward_boundary()


def test_a_step_that_raises_does_not_count_the_micro_batch() -> None:
    clock = AccumulationClock(gradient_accumulation_steps=2)
    with pytest.raises(ValueError):
        with clock.stepping():
            raise ValueError("optimizer failed")
    assert clock.micro_steps == 0 and clock.phase is ClockPhase.ACCUMULATING


def test_an_illegal_clock_move_names_the_rank_and_both_phases() -> None:
    clock = AccumulationClock(rank=3)
    with pytest.raises(AssertionError, match="rank 3: accumulation clock moving NO_SYNC -> STEPPING"):
        with clock.no_sync(), clock.stepping():
            pass


def test_plain_backwards_without_the_loss_scale_are_counted_until_zero_grad() -> None:
    clock = AccumulationClock()
    clock.count_implicit_backward()
    assert clock.unscaled_implicit_backwards()
    clock.count_scaled_loss()
    assert not clock.unscaled_implicit_backwards()
    clock.count_implicit_backward()
    clock.restart()
    assert not clock.unscaled_implicit_backwards() and clock.implicit_backwards == 0


class _Recorder(Strategy):
    """The backward pass machinery alone: records before/after_backward."""

    def __init__(self) -> None:  # no config, no tensors
        self.backward_pass = BackwardPass.IDLE
        self.accumulation = AccumulationClock()
        self.comm_ledger = comm.CommLedger()  # end_backward counts its collectives in it
        self.calls: list[tuple[str, bool]] = []

    def before_backward(self, boundary: bool) -> None:
        self.calls.append(("before", boundary))

    def after_backward(self, boundary: bool) -> None:
        self.calls.append(("after", boundary))

    # the rest of the contract is not used here
    wrap = finish_reduction = found_overflow = first_overflow_name = step = zero_grad = None
    pieces = piece_index = after_load = ledger = None


def test_backward_pass_moves_through_its_states() -> None:
    strategy = _Recorder()
    strategy.begin_backward(True)
    assert strategy.backward_pass is BackwardPass.EXPLICIT
    strategy.entering_backward_hook()  # a hook inside the engine's pass changes nothing
    strategy.end_backward(True)
    assert strategy.backward_pass is BackwardPass.IDLE and strategy.calls == [("before", True), ("after", True)]
    strategy.begin_backward(False)
    strategy.abort_backward()
    assert strategy.backward_pass is BackwardPass.IDLE and strategy.calls[-1] == ("before", False)


def test_an_illegal_backward_pass_move_names_both_states() -> None:
    strategy = _Recorder()
    with pytest.raises(AssertionError, match=r"rank 0: backward pass IDLE -> CLOSING, legal only from EXPLICIT or IMPLICIT"):
        strategy.end_backward(True)
    strategy.begin_backward(True)
    with pytest.raises(AssertionError, match=r"rank 0: backward pass EXPLICIT -> EXPLICIT"):
        strategy.begin_backward(True)
