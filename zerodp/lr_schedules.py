"""DeepSpeed's learning-rate schedulers: same names, parameters, defaults and curves.

A DeepSpeed config names one of these in `scheduler.type` and gives its keyword arguments in
`scheduler.params`; `build_scheduler` resolves the name (a DeepSpeed name first, then a
`torch.optim.lr_scheduler` class) and constructs it. The engine calls `step()` once per optimizer
step, after the optimizer, and not on a step skipped for overflow.

    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"total_num_steps": 10000, "warmup_num_steps": 500, "warmup_max_lr": 3e-4}}

The curves are small pure functions (`warmup_lr`, `warmup_decay_lr`, `warmup_cosine_ratio`,
`lr_range_test_lr`, `one_cycle_lr`, `one_cycle_momentum`); the classes only hold parameters, the
iteration counter and the optimizer, and write what the functions return into its param groups.

[Note: iteration numbering]
`last_batch_iteration` is DeepSpeed's counter: -1 at construction, then 0, 1, 2, ... after each
`step()`. The lr for iteration i is written into the optimizer when `step()` reaches i, and the
engine steps the scheduler *after* the optimizer, so optimizer step k (0-based) runs with the lr of
iteration k-1. Construction with `last_batch_iteration=-1` writes the iteration -1 lr, as DeepSpeed
does: warmup_min_lr (WarmupLR, WarmupDecayLR), 0.0 (WarmupCosineLR), lr_range_test_min_lr
(LRRangeTest), cycle_min_lr (OneCycle). Constructing with another value writes nothing: the optimizer
is assumed to hold that iteration's lr already (resume), and the next `step()` moves on from it.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any

import torch

from zerodp.log import warn_once

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
WARMUP_TYPES = (WARMUP_LOG, WARMUP_LINEAR)


# ---------------------------------------------------------------------------------------------
# Pure schedule math: numbers in, numbers out. `iteration` is `last_batch_iteration`.
# ---------------------------------------------------------------------------------------------


def warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str = WARMUP_LOG) -> float:
    """Fraction of the warmup done at `iteration`: 0 before the start, 1 once warmup is over.

    log: ln(iteration + 1) / ln(N); linear: iteration / N; N = max(2, warmup_num_steps).
    """
    num_steps = max(2, warmup_num_steps)
    if iteration < 0:
        return 0.0
    if iteration >= num_steps:
        return 1.0
    if warmup_type == WARMUP_LOG:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def warmup_lr(
    iteration: int, min_lr: float, max_lr: float, warmup_num_steps: int, warmup_type: str = WARMUP_LOG
) -> float:
    """WarmupLR: min_lr + (max_lr - min_lr) * gamma, held at max_lr after the warmup."""
    return min_lr + (max_lr - min_lr) * warmup_gamma(iteration, warmup_num_steps, warmup_type)


def warmup_decay_lr(
    iteration: int,
    min_lr: float,
    max_lr: float,
    warmup_num_steps: int,
    total_num_steps: int,
    warmup_type: str = WARMUP_LOG,
) -> float:
    """WarmupDecayLR: WarmupLR's warmup, then a linear decay that reaches min_lr at total_num_steps.

    After warmup gamma = max(0, (total - iteration) / max(1, total - N)); lr = min + (max-min)*gamma.
    """
    num_steps = max(2, warmup_num_steps)
    if iteration < num_steps:
        return warmup_lr(iteration, min_lr, max_lr, num_steps, warmup_type)
    gamma = max(0.0, (total_num_steps - iteration) / max(1.0, total_num_steps - num_steps))
    return min_lr + (max_lr - min_lr) * gamma


def warmup_cosine_ratio(
    iteration: int,
    warmup_num_steps: int,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = WARMUP_LOG,
) -> float:
    """WarmupCosineLR: the multiplier of each group's original lr at `iteration`.

    0 before the start; warmup from warmup_min_ratio to 1; then cos_min_ratio + (1 - cos_min_ratio)
    * (1 + cos(pi * p)) / 2 with p = (iteration - N + 1) / max(1, total - N) clamped to [0, 1], so
    the ratio stays at cos_min_ratio after total_num_steps instead of rising again.
    """
    num_steps = max(2, warmup_num_steps)
    if iteration < 0:
        return 0.0
    if iteration < num_steps:
        gamma = warmup_gamma(iteration, num_steps, warmup_type)
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * gamma
    progress = min(1.0, max(0.0, (iteration - num_steps + 1) / max(1, total_num_steps - num_steps)))
    cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)


def lr_range_test_lr(
    iteration: int, min_lr: float, step_size: float, step_rate: float, staircase: bool = False
) -> float:
    """LRRangeTest: min_lr * (1 + step_rate * interval), interval = (iteration + 1) / step_size,
    floored when `staircase`."""
    interval = (iteration + 1) / step_size
    if staircase:
        interval = math.floor(interval)
    return min_lr * (1.0 + step_rate * interval)


def one_cycle_scale(
    iteration: int,
    first_step_size: float,
    second_step_size: float,
    first_stair_count: int = 0,
    second_stair_count: int = 0,
) -> float:
    """OneCycle: where in the cycle `iteration` is, 0 (cycle_min) .. 1 (cycle_max) .. 0.

    The position is iteration + 1 steps into a cycle of first + second steps: it climbs for
    `first_step_size` steps and falls for `second_step_size`. A stair count > 0 holds the value flat
    on that many stairs per half instead of moving it every step (floor of the position).
    """
    total_size = first_step_size + second_step_size
    position = (iteration + 1) % total_size
    if position <= first_step_size:
        offset, half_size, stair_count = position, first_step_size, first_stair_count
    else:
        offset, half_size, stair_count = total_size - position, second_step_size, second_stair_count
    if stair_count > 0:
        # Multiply before dividing: offset / half_size * stairs can land 1 ulp under a whole stair
        # and floor() would then drop the schedule a stair (even off the peak).
        return math.floor(offset * stair_count / half_size) / stair_count
    return offset / half_size


def one_cycle_lr(
    iteration: int,
    cycle_min_lr: float,
    cycle_max_lr: float,
    cycle_shape: tuple[float, float, int, int],
    decay_step_size: float = 0,
    decay_lr_rate: float = 0.0,
) -> float:
    """OneCycle lr: min + (max - min) * scale during the cycle; after it, cycle_min_lr divided by
    (1 + decay_lr_rate * steps_after_cycle / decay_step_size) (no decay when either is 0).

    `cycle_shape` = (first_step_size, second_step_size, first_stair_count, second_stair_count).
    """
    first, second = cycle_shape[0], cycle_shape[1]
    if iteration < first + second:
        return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * one_cycle_scale(iteration, *cycle_shape)
    if decay_step_size == 0 or decay_lr_rate == 0:
        return cycle_min_lr
    decay_interval = (iteration - (first + second) + 1) / decay_step_size
    return cycle_min_lr / (1.0 + decay_lr_rate * decay_interval)


def one_cycle_momentum(
    iteration: int,
    cycle_min_mom: float,
    cycle_max_mom: float,
    cycle_shape: tuple[float, float, int, int],
    decay_step_size: float = 0,
    decay_mom_rate: float = 0.0,
) -> float:
    """OneCycle momentum (Adam beta1 or SGD momentum), inverse to the lr: max - (max - min) * scale
    during the cycle; after it, cycle_max_mom divided by (1 + decay_mom_rate * interval)."""
    first, second = cycle_shape[0], cycle_shape[1]
    if iteration < first + second:
        return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * one_cycle_scale(iteration, *cycle_shape)
    if decay_step_size == 0 or decay_mom_rate == 0:
        return cycle_max_mom
    decay_interval = (iteration - (first + second) + 1) / decay_step_size
    return cycle_max_mom / (1.0 + decay_mom_rate * decay_interval)


# ---------------------------------------------------------------------------------------------
# Parameter checks: collect every problem, raise once, name `scheduler.params.<key>`.
# ---------------------------------------------------------------------------------------------


class SchedulerParamsError(ValueError):
    """Invalid scheduler arguments; `problems` holds one "scheduler.params.KEY = ..." line each."""

    def __init__(self, scheduler_name: str, problems: list[str]) -> None:
        super().__init__(f"invalid {scheduler_name} parameters:\n  " + "\n  ".join(problems))
        self.problems = problems


class _ParamProblems:
    """Collects invalid `scheduler.params` values so the user sees all of them in one error."""

    def __init__(self, scheduler_name: str) -> None:
        self.scheduler_name = scheduler_name
        self.messages: list[str] = []

    def add(self, key: str, value: Any, expected: str, fix: str) -> None:
        self.messages.append(f"scheduler.params.{key} = {value!r}: expected {expected}. Fix: {fix}")

    def raise_if_any(self) -> None:
        if self.messages:
            raise SchedulerParamsError(self.scheduler_name, self.messages)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(problems: _ParamProblems, key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.add(key, value, f"an integer >= {minimum}", f"set {key} to a whole number >= {minimum}")


def _check_number(
    problems: _ParamProblems, key: str, value: Any, low: float, high: float = math.inf, positive: bool = False
) -> None:
    in_range = _is_number(value) and low <= value <= high and not (positive and value <= low)
    if not in_range:
        bound = f"> {low}" if positive else f">= {low}"
        expected = f"a number {bound}" + (f" and <= {high}" if high != math.inf else "")
        problems.add(key, value, expected, f"set {key} to {expected}")


def _per_group(problems: _ParamProblems, key: str, value: Any, num_groups: int) -> list[float]:
    """A scalar for every param group, or one value per group (DeepSpeed's "float or list")."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_groups
    if len(values) != num_groups:
        problems.add(key, value, f"one number or a list of {num_groups} (one per param group)",
                     f"give {key} as a single number or {num_groups} numbers")
        return [0.0] * num_groups
    for item in values:
        if not (_is_number(item) and item >= 0):
            problems.add(key, value, "learning rates >= 0", f"set {key} to non-negative numbers")
            return [0.0] * num_groups
    return [float(item) for item in values]


def _check_warmup_type(problems: _ParamProblems, warmup_type: Any) -> None:
    if warmup_type not in WARMUP_TYPES:
        problems.add("warmup_type", warmup_type, "'log' or 'linear'",
                     'set warmup_type to "log" (the default) or "linear"')


def _check_total_steps(problems: _ParamProblems, total_num_steps: Any, warmup_num_steps: Any) -> None:
    _check_int(problems, "total_num_steps", total_num_steps, 1)
    if _is_number(total_num_steps) and _is_number(warmup_num_steps) and total_num_steps < warmup_num_steps:
        problems.add("total_num_steps", total_num_steps, f">= warmup_num_steps ({warmup_num_steps})",
                     "raise total_num_steps to the number of optimizer steps of the run, "
                     "or lower warmup_num_steps")


# ---------------------------------------------------------------------------------------------
# Schedulers
# ---------------------------------------------------------------------------------------------


def _param_groups_owner(optimizer: Any) -> Any:
    """The object whose `param_groups` the schedule writes: the optimizer, or the torch optimizer
    inside a wrapper that has `.optimizer` (as DeepSpeed accepts)."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups: pass a torch.optim.Optimizer")


def _as_float(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class _Scheduler:
    """Shared machinery: the iteration counter, writing lrs into the optimizer, state_dict.

    Subclasses implement `_lrs_at(iteration)`; `_captured_lrs` names the per-group lrs that were
    read from the optimizer (not from params), which state_dict carries so a resume does not depend
    on the optimizer's lr at construction time.
    """

    _captured_lrs: str | None = None

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _param_groups_owner(optimizer)
        self.last_batch_iteration = last_batch_iteration
        # What the optimizer's groups hold now; get_last_lr() before the first write returns this.
        self._last_lr = [_as_float(group["lr"]) for group in self.optimizer.param_groups]

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The lr of every param group at the current `last_batch_iteration`."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer's param groups."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write its lr.

        `batch_iteration` is the keyword DeepSpeed's OneCycle and LRRangeTest use for the same thing.
        """
        if last_batch_iteration is None:
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (capturable / compiled optimizers)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)  # the floats written, not read back: no device sync per step

    def state_dict(self) -> dict:
        """Plain data: {"last_batch_iteration": int} (+ "base_lrs" read from the optimizer)."""
        state: dict[str, Any] = {"last_batch_iteration": self.last_batch_iteration}
        if self._captured_lrs is not None:
            state["base_lrs"] = list(getattr(self, self._captured_lrs))
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from `state_dict()` (or DeepSpeed's {"last_batch_iteration": k}) and write that
        iteration's lr into the optimizer."""
        iteration = state_dict.get("last_batch_iteration") if isinstance(state_dict, dict) else None
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValueError(f"{type(self).__name__} state_dict needs an integer 'last_batch_iteration', "
                             f"got {state_dict!r}")
        base_lrs = state_dict.get("base_lrs")
        if base_lrs is not None and self._captured_lrs is not None:
            if len(base_lrs) != len(self.optimizer.param_groups):
                raise ValueError(f"{type(self).__name__} state_dict has {len(base_lrs)} base_lrs but the "
                                 f"optimizer has {len(self.optimizer.param_groups)} param groups")
            setattr(self, self._captured_lrs, [float(lr) for lr in base_lrs])
        self.last_batch_iteration = iteration
        self._apply()


class WarmupLR(_Scheduler):
    """Warm the lr of every param group up from `warmup_min_lr` to `warmup_max_lr` over
    `warmup_num_steps` steps (log or linear), then hold it.

    Args:
        optimizer: the torch optimizer (or a wrapper with `.optimizer`).
        warmup_min_lr: start lr, a number or one per param group. Default 0.0.
        warmup_max_lr: end lr, a number or one per param group; None (default) = each group's lr.
        warmup_num_steps: steps of warmup, an integer >= 1 (used as max(2, value)). Default 1000.
        warmup_type: "log" (default, ln(it+1)/ln(N)) or "linear" (it/N).
        last_batch_iteration: the iteration to resume from; -1 (default) starts at the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            self._captured_lrs = "max_lrs"
        problems = _ParamProblems(type(self).__name__)
        num_groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(problems, "warmup_min_lr", warmup_min_lr, num_groups)
        self.max_lrs = (list(self._last_lr) if warmup_max_lr is None
                        else _per_group(problems, "warmup_max_lr", warmup_max_lr, num_groups))
        for min_lr, max_lr in zip(self.min_lrs, self.max_lrs):
            if max_lr < min_lr:
                where = "the optimizer's lr" if warmup_max_lr is None else "warmup_max_lr"
                problems.add("warmup_min_lr", warmup_min_lr, f"<= {where} ({max_lr})",
                             f"lower warmup_min_lr or raise {where}")
                break
        _check_int(problems, "warmup_num_steps", warmup_num_steps, 1)
        _check_warmup_type(problems, warmup_type)
        self._check_extra_params(problems, warmup_num_steps)
        problems.raise_if_any()
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def _check_extra_params(self, problems: _ParamProblems, warmup_num_steps: Any) -> None:
        """Hook for subclasses that take more parameters."""

    def _lrs_at(self, iteration: int) -> list[float]:
        return [warmup_lr(iteration, lo, hi, self.warmup_num_steps, self.warmup_type)
                for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay that reaches `warmup_min_lr` at `total_num_steps`.

    Args:
        total_num_steps: optimizer steps of the whole run (required), >= warmup_num_steps.
        warmup_max_lr: peak lr, a number or one per group. Default 0.001 (not the optimizer's lr).
        Other arguments as WarmupLR.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _check_extra_params(self, problems: _ParamProblems, warmup_num_steps: Any) -> None:
        _check_total_steps(problems, self.total_num_steps, warmup_num_steps)

    def _lrs_at(self, iteration: int) -> list[float]:
        return [warmup_decay_lr(iteration, lo, hi, self.warmup_num_steps, self.total_num_steps,
                                self.warmup_type)
                for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupCosineLR(_Scheduler):
    """Scale each param group's original lr by a ratio that warms up from `warmup_min_ratio` to 1
    and then follows a cosine down to `cos_min_ratio` at `total_num_steps` (held there after).

    Args:
        optimizer: the torch optimizer (its groups' lrs at construction are the 1.0 of the ratio).
        total_num_steps: optimizer steps of the whole run (required), >= warmup_num_steps.
        warmup_min_ratio: ratio at the first step, in [0, 1]. Default 0.0.
        warmup_num_steps: steps of warmup, an integer >= 1 (used as max(2, value)). Default 1000.
        cos_min_ratio: final ratio, in [0, 1]. Default 0.0001.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: the iteration to resume from; -1 (default) starts at the beginning.
    """

    _captured_lrs = "org_lrs"

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        problems = _ParamProblems(type(self).__name__)
        _check_number(problems, "warmup_min_ratio", warmup_min_ratio, 0.0, 1.0)
        _check_number(problems, "cos_min_ratio", cos_min_ratio, 0.0, 1.0)
        _check_int(problems, "warmup_num_steps", warmup_num_steps, 1)
        _check_total_steps(problems, total_num_steps, warmup_num_steps)
        _check_warmup_type(problems, warmup_type)
        problems.raise_if_any()
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = list(self._last_lr)
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        """The multiplier of the original lrs at the current iteration."""
        return warmup_cosine_ratio(self.last_batch_iteration, self.warmup_num_steps, self.total_num_steps,
                                   self.warmup_min_ratio, self.cos_min_ratio, self.warmup_type)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = warmup_cosine_ratio(iteration, self.warmup_num_steps, self.total_num_steps,
                                    self.warmup_min_ratio, self.cos_min_ratio, self.warmup_type)
        return [org_lr * ratio for org_lr in self.org_lrs]


class LRRangeTest(_Scheduler):
    """Grow the lr from `lr_range_test_min_lr` by `lr_range_test_step_rate` every
    `lr_range_test_step_size` steps (continuously, or in stairs) to find the largest stable lr.

    Args:
        lr_range_test_min_lr: start lr, a number or one per param group. Default 1e-3.
        lr_range_test_step_size: steps per unit of growth, > 0. Default 2000.
        lr_range_test_step_rate: growth per unit, >= 0. Default 1.0.
        lr_range_test_staircase: grow in whole stairs instead of every step. Default False.
        last_batch_iteration: the iteration to resume from; -1 (default) starts at the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        problems = _ParamProblems(type(self).__name__)
        num_groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(problems, "lr_range_test_min_lr", lr_range_test_min_lr, num_groups)
        _check_number(problems, "lr_range_test_step_size", lr_range_test_step_size, 0.0, positive=True)
        _check_number(problems, "lr_range_test_step_rate", lr_range_test_step_rate, 0.0)
        if not isinstance(lr_range_test_staircase, bool):
            problems.add("lr_range_test_staircase", lr_range_test_staircase, "true or false",
                         "set lr_range_test_staircase to a boolean")
        problems.raise_if_any()
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply()

    def _lrs_at(self, iteration: int) -> list[float]:
        return [lr_range_test_lr(iteration, min_lr, self.step_size, self.step_rate, self.staircase)
                for min_lr in self.min_lrs]


class OneCycle(_Scheduler):
    """The 1cycle policy: the lr climbs from `cycle_min_lr` to `cycle_max_lr` over
    `cycle_first_step_size` steps, falls back over `cycle_second_step_size`, then decays; momentum
    (Adam beta1 or SGD momentum) moves the opposite way between `cycle_max_mom` and `cycle_min_mom`.

    Args:
        cycle_min_lr, cycle_max_lr: the lr bounds (required), numbers or one per param group.
        decay_lr_rate: post-cycle lr = cycle_min_lr / (1 + rate * steps_after / decay_step_size).
        cycle_first_step_size: steps of the rising half, > 0. Default 2000.
        cycle_second_step_size: steps of the falling half; None (default) = cycle_first_step_size.
        cycle_first_stair_count: stairs in the rising half; 0 (default) = continuous.
        cycle_second_stair_count: stairs in the falling half; None (default) = the first count.
        decay_step_size: steps per unit of post-cycle decay; 0 (default) = no decay.
        cycle_momentum: cycle momentum inversely to the lr. Default True.
        cycle_min_mom, cycle_max_mom: momentum bounds in [0, 1). Defaults 0.8, 0.9.
        decay_mom_rate: post-cycle momentum = cycle_max_mom / (1 + rate * interval). Default 0.
        last_batch_iteration: the iteration to resume from; -1 (default) starts at the beginning.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        problems = _ParamProblems(type(self).__name__)
        num_groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(problems, "cycle_min_lr", cycle_min_lr, num_groups)
        self.max_lrs = _per_group(problems, "cycle_max_lr", cycle_max_lr, num_groups)
        if any(hi < lo for lo, hi in zip(self.min_lrs, self.max_lrs)):
            problems.add("cycle_max_lr", cycle_max_lr, f">= cycle_min_lr ({cycle_min_lr})",
                         "swap cycle_min_lr and cycle_max_lr, or raise cycle_max_lr")
        self.cycle_shape = self._check_cycle_shape(
            problems, cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
            cycle_second_stair_count)
        _check_number(problems, "decay_step_size", decay_step_size, 0.0)
        _check_number(problems, "decay_lr_rate", decay_lr_rate, 0.0)
        _check_number(problems, "decay_mom_rate", decay_mom_rate, 0.0)
        _check_number(problems, "cycle_min_mom", cycle_min_mom, 0.0, 1.0)
        _check_number(problems, "cycle_max_mom", cycle_max_mom, 0.0, 1.0)
        if _is_number(cycle_min_mom) and _is_number(cycle_max_mom) and cycle_max_mom < cycle_min_mom:
            problems.add("cycle_max_mom", cycle_max_mom, f">= cycle_min_mom ({cycle_min_mom})",
                         "swap cycle_min_mom and cycle_max_mom")
        problems.raise_if_any()
        self.decay_lr_rate, self.decay_step_size = decay_lr_rate, decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.momentum_key = self._momentum_key() if cycle_momentum else None
        self.cycle_momentum = self.momentum_key is not None
        if last_batch_iteration == -1:
            self._apply()

    @staticmethod
    def _check_cycle_shape(
        problems: _ParamProblems, first_size: Any, second_size: Any, first_stairs: Any, second_stairs: Any
    ) -> tuple[float, float, int, int]:
        _check_number(problems, "cycle_first_step_size", first_size, 0.0, positive=True)
        if second_size is not None:
            _check_number(problems, "cycle_second_step_size", second_size, 0.0, positive=True)
        _check_int(problems, "cycle_first_stair_count", first_stairs, 0)
        if second_stairs is not None:
            _check_int(problems, "cycle_second_stair_count", second_stairs, 0)
        first = float(first_size) if _is_number(first_size) else 1.0
        second = float(second_size) if _is_number(second_size) else first
        return (first, second, first_stairs, first_stairs if second_stairs is None else second_stairs)

    def _momentum_key(self) -> str | None:
        groups = self.optimizer.param_groups
        if all("betas" in group for group in groups):
            return "betas"
        if all("momentum" in group for group in groups):
            return "momentum"
        warn_once(f"OneCycle: cycle_momentum is off because {type(self.optimizer).__name__} has "
                  "neither 'betas' nor 'momentum' in its param groups")
        return None

    def _lrs_at(self, iteration: int) -> list[float]:
        return [one_cycle_lr(iteration, lo, hi, self.cycle_shape, self.decay_step_size, self.decay_lr_rate)
                for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_mom(self) -> list[float] | None:
        """Momentum (beta1) of every param group at the current iteration; None when not cycled."""
        if not self.cycle_momentum:
            return None
        momentum = one_cycle_momentum(self.last_batch_iteration, self.min_mom, self.max_mom,
                                      self.cycle_shape, self.decay_step_size, self.decay_mom_rate)
        return [momentum] * len(self.optimizer.param_groups)

    def _apply(self) -> None:
        super()._apply()
        momenta = self.get_mom() if self.momentum_key is not None else None
        for group, momentum in zip(self.optimizer.param_groups, momenta or []):
            if self.momentum_key == "betas":
                group["betas"] = (momentum, *tuple(group["betas"])[1:])  # beta2 is the group's own
            else:
                group["momentum"] = momentum


# ---------------------------------------------------------------------------------------------
# Lookup by config name
# ---------------------------------------------------------------------------------------------

DEEPSPEED_SCHEDULERS: dict[str, type] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _torch_scheduler_names() -> list[str]:
    module = torch.optim.lr_scheduler
    base = getattr(module, "LRScheduler", module._LRScheduler)
    return sorted(name for name, obj in vars(module).items()
                  if isinstance(obj, type) and issubclass(obj, base) and not name.startswith("_")
                  and name != "LRScheduler")


def _check_param_keys(type_name: str, cls: type, params: dict) -> None:
    signature = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    required = [name for name, p in signature.parameters.items()
                if name in accepted and p.default is inspect.Parameter.empty]
    problems = _ParamProblems(type_name)
    for key in params:
        if key not in accepted:
            problems.add(key, params[key], f"a parameter of {type_name} ({', '.join(accepted)})",
                         f"remove {key} or correct its spelling")
    for key in required:
        if key not in params:
            problems.add(key, None, f"a value: {type_name} requires it", f"add {key} to scheduler.params")
    problems.raise_if_any()


def build_scheduler(type_name: str, params: dict | None, optimizer: Any) -> Any:
    """Construct the scheduler a config's `scheduler: {type, params}` names.

    The name is looked up among DeepSpeed's schedulers first (`DEEPSPEED_SCHEDULERS`), then among
    the classes of `torch.optim.lr_scheduler`; `params` are its keyword arguments.
    Raises ValueError for an unknown name (listing the valid ones) or unknown/missing params.
    """
    params = dict(params or {})
    cls = DEEPSPEED_SCHEDULERS.get(type_name)
    torch_names = _torch_scheduler_names()
    if cls is None and type_name in torch_names:
        cls = getattr(torch.optim.lr_scheduler, type_name)
        if not isinstance(optimizer, torch.optim.Optimizer):  # torch's schedulers need the real one
            optimizer = _param_groups_owner(optimizer)
    if cls is None:
        valid = [*DEEPSPEED_SCHEDULERS, *torch_names]
        close = difflib.get_close_matches(str(type_name), valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"scheduler.type = {type_name!r} is neither a DeepSpeed scheduler "
                         f"({', '.join(DEEPSPEED_SCHEDULERS)}) nor a torch.optim.lr_scheduler class "
                         f"({', '.join(torch_names)}).{hint} Names are case-sensitive.")
    _check_param_keys(type_name, cls, params)
    return cls(optimizer, **params)

