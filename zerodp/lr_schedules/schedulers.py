"""DeepSpeed's learning-rate schedulers: same names, parameters, defaults and curves.

A DeepSpeed config names one of these in `scheduler.type` and gives its keyword arguments in
`scheduler.params`; `build_scheduler` (zerodp/lr_schedules/build.py) resolves the name and
constructs it. The engine calls `step()` once per optimizer step, after the optimizer, and not on a
step skipped for overflow.

    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"total_num_steps": 10000, "warmup_num_steps": 500, "warmup_max_lr": 3e-4}}

The curves are small pure functions (zerodp/lr_schedules/curves.py); the checks on the parameters
are zerodp.config.schedulers', which the config runs too (see [Note: one table, two readers] there);
the classes only hold parameters, the iteration counter and the optimizer, and write what the
curves return into its param groups.

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

from typing import Any

import torch

from zerodp.config.schedulers import (
    WARMUP_LOG,
    ParamProblems,
    check_lr_range_test,
    check_one_cycle,
    check_total_steps,
    check_warmup_cosine_lr,
    check_warmup_lr,
)
from zerodp.lr_schedules.curves import (
    lr_range_test_lr,
    one_cycle_lr,
    one_cycle_momentum,
    warmup_cosine_ratio,
    warmup_decay_lr,
    warmup_lr,
)
from zerodp.log import warn_once


def param_groups_owner(optimizer: Any) -> Any:
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
        self.optimizer = param_groups_owner(optimizer)
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
        problems = ParamProblems(type(self).__name__)
        self.min_lrs, self.max_lrs = check_warmup_lr(problems, self._last_lr, warmup_min_lr, warmup_max_lr,
                                                     warmup_num_steps, warmup_type)
        self._check_extra_params(problems, warmup_num_steps)
        problems.raise_if_any()
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def _check_extra_params(self, problems: ParamProblems, warmup_num_steps: Any) -> None:
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

    def _check_extra_params(self, problems: ParamProblems, warmup_num_steps: Any) -> None:
        check_total_steps(problems, self.total_num_steps, warmup_num_steps)

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
        problems = ParamProblems(type(self).__name__)
        check_warmup_cosine_lr(problems, total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio,
                               warmup_type)
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
        problems = ParamProblems(type(self).__name__)
        self.min_lrs = check_lr_range_test(problems, len(self.optimizer.param_groups), lr_range_test_min_lr,
                                           lr_range_test_step_size, lr_range_test_step_rate, lr_range_test_staircase)
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
        problems = ParamProblems(type(self).__name__)
        self.min_lrs, self.max_lrs, self.cycle_shape = check_one_cycle(problems, len(self.optimizer.param_groups), {
            "cycle_min_lr": cycle_min_lr, "cycle_max_lr": cycle_max_lr, "decay_lr_rate": decay_lr_rate,
            "cycle_first_step_size": cycle_first_step_size, "cycle_second_step_size": cycle_second_step_size,
            "cycle_first_stair_count": cycle_first_stair_count, "cycle_second_stair_count": cycle_second_stair_count,
            "decay_step_size": decay_step_size, "cycle_min_mom": cycle_min_mom, "cycle_max_mom": cycle_max_mom,
            "decay_mom_rate": decay_mom_rate})
        problems.raise_if_any()
        self.decay_lr_rate, self.decay_step_size = decay_lr_rate, decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.momentum_key = self._momentum_key() if cycle_momentum else None
        self.cycle_momentum = self.momentum_key is not None
        if last_batch_iteration == -1:
            self._apply()

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
