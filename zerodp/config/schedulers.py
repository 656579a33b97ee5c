"""DeepSpeed's five learning-rate schedulers as the config sees them: their names, their
parameters (names, defaults, which are required) and the checks on their values.

The config validates `scheduler.params` with these before any process group exists, and the
scheduler classes in `zerodp.lr_schedules` run the same checks when they are built, so
`zerodp config check` and `initialize` refuse the same values in the same words:

    problems = ParamProblems("WarmupLR")
    min_lrs, max_lrs = check_warmup_lr(problems, [1e-3], warmup_min_lr=0.01, warmup_max_lr=None,
                                       warmup_num_steps=1000, warmup_type="log")
    problems.messages
    # ["scheduler.params.warmup_min_lr = 0.01: expected <= the optimizer's lr (0.001). Fix: ..."]

[Note: one table, two readers]
The config layer is zerodp's bottom layer, so it cannot read the schedulers' signatures from
`zerodp.lr_schedules`; DEEPSPEED_SCHEDULER_PARAMS spells them here instead, and
tests/test_lr_schedules.py checks that every class's signature matches its row (names, order,
defaults, required-ness: DeepSpeed's). The value checks are pure (numbers in, messages out): the
param groups' lrs are the only thing they need from an optimizer.
"""

from __future__ import annotations

import math
from typing import Any

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
WARMUP_TYPES = (WARMUP_LOG, WARMUP_LINEAR)

REQUIRED = object()
"""The default of a parameter DeepSpeed's scheduler requires (it has none)."""

DEEPSPEED_SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": WARMUP_LOG,
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": WARMUP_LOG, "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": WARMUP_LOG, "last_batch_iteration": -1},
}
"""{scheduler name: {parameter: default or REQUIRED}}, each in its class's signature order (after
`optimizer`). See [Note: one table, two readers]."""

DEEPSPEED_SCHEDULER_NAMES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
"""The names `scheduler.type` may give for DeepSpeed's schedulers, in the order messages list them."""


# ---------------------------------------------------------------------------------------------
# Collecting problems: every one named `scheduler.params.<key>`, raised once
# ---------------------------------------------------------------------------------------------


class SchedulerParamsError(ValueError):
    """Invalid scheduler arguments; `problems` holds one "scheduler.params.KEY = ..." line each."""

    def __init__(self, scheduler_name: str, problems: list[str]) -> None:
        super().__init__(f"invalid {scheduler_name} parameters:\n  " + "\n  ".join(problems))
        self.scheduler_name, self.problems = scheduler_name, problems

    def __reduce__(self) -> tuple:
        return type(self), (self.scheduler_name, self.problems)


class ParamProblems:
    """Collects invalid `scheduler.params` values so the user sees all of them in one error."""

    def __init__(self, scheduler_name: str) -> None:
        self.scheduler_name = scheduler_name
        self.messages: list[str] = []

    def add(self, key: str, value: Any, expected: str, fix: str) -> None:
        """Record "scheduler.params.KEY = VALUE: expected EXPECTED. Fix: FIX"."""
        self.messages.append(f"scheduler.params.{key} = {value!r}: expected {expected}. Fix: {fix}")

    def raise_if_any(self) -> None:
        """Raise SchedulerParamsError with every message recorded, if there is one."""
        if self.messages:
            raise SchedulerParamsError(self.scheduler_name, self.messages)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(problems: ParamProblems, key: str, value: Any, minimum: int) -> None:
    """`value` must be an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.add(key, value, f"an integer >= {minimum}", f"set {key} to a whole number >= {minimum}")


def check_number(
    problems: ParamProblems, key: str, value: Any, low: float, high: float = math.inf, positive: bool = False
) -> None:
    """`value` must be a finite number in [low, high] (in (low, high] when `positive`)."""
    in_range = is_number(value) and low <= value <= high and not (positive and value <= low)
    if not in_range:
        bound = f"> {low}" if positive else f">= {low}"
        expected = f"a number {bound}" + (f" and <= {high}" if high != math.inf else "")
        problems.add(key, value, expected, f"set {key} to {expected}")


def per_group(problems: ParamProblems, key: str, value: Any, num_groups: int) -> list[float]:
    """A scalar for every param group, or one value per group (DeepSpeed's "float or list")."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_groups
    if len(values) != num_groups:
        problems.add(key, value, f"one number or a list of {num_groups} (one per param group)",
                     f"give {key} as a single number or {num_groups} numbers")
        return [0.0] * num_groups
    for item in values:
        if not (is_number(item) and item >= 0):
            problems.add(key, value, "learning rates >= 0", f"set {key} to non-negative numbers")
            return [0.0] * num_groups
    return [float(item) for item in values]


def check_warmup_type(problems: ParamProblems, warmup_type: Any) -> None:
    """`warmup_type` must be "log" or "linear"."""
    if warmup_type not in WARMUP_TYPES:
        problems.add("warmup_type", warmup_type, "'log' or 'linear'",
                     'set warmup_type to "log" (the default) or "linear"')


def check_total_steps(problems: ParamProblems, total_num_steps: Any, warmup_num_steps: Any) -> None:
    """`total_num_steps` must be an integer >= 1 and no fewer than `warmup_num_steps`."""
    check_int(problems, "total_num_steps", total_num_steps, 1)
    if is_number(total_num_steps) and is_number(warmup_num_steps) and total_num_steps < warmup_num_steps:
        problems.add("total_num_steps", total_num_steps, f">= warmup_num_steps ({warmup_num_steps})",
                     "raise total_num_steps to the number of optimizer steps of the run, "
                     "or lower warmup_num_steps")


# ---------------------------------------------------------------------------------------------
# One check per scheduler (the classes in zerodp.lr_schedules call these)
# ---------------------------------------------------------------------------------------------


def check_warmup_lr(problems: ParamProblems, group_lrs: list[float], warmup_min_lr: Any, warmup_max_lr: Any,
                    warmup_num_steps: Any, warmup_type: Any) -> tuple[list[float], list[float]]:
    """WarmupLR's values; returns (min_lrs, max_lrs) per param group. `group_lrs`: the lrs the
    optimizer's groups hold, which are the max lrs when warmup_max_lr is None."""
    num_groups = len(group_lrs)
    min_lrs = per_group(problems, "warmup_min_lr", warmup_min_lr, num_groups)
    max_lrs = (list(group_lrs) if warmup_max_lr is None
               else per_group(problems, "warmup_max_lr", warmup_max_lr, num_groups))
    for min_lr, max_lr in zip(min_lrs, max_lrs):
        if max_lr < min_lr:
            where = "the optimizer's lr" if warmup_max_lr is None else "warmup_max_lr"
            problems.add("warmup_min_lr", warmup_min_lr, f"<= {where} ({max_lr})",
                         f"lower warmup_min_lr or raise {where}")
            break
    check_int(problems, "warmup_num_steps", warmup_num_steps, 1)
    check_warmup_type(problems, warmup_type)
    return min_lrs, max_lrs


def check_warmup_cosine_lr(problems: ParamProblems, total_num_steps: Any, warmup_min_ratio: Any,
                           warmup_num_steps: Any, cos_min_ratio: Any, warmup_type: Any) -> None:
    """WarmupCosineLR's values: ratios in [0, 1], whole step counts, total >= warmup."""
    check_number(problems, "warmup_min_ratio", warmup_min_ratio, 0.0, 1.0)
    check_number(problems, "cos_min_ratio", cos_min_ratio, 0.0, 1.0)
    check_int(problems, "warmup_num_steps", warmup_num_steps, 1)
    check_total_steps(problems, total_num_steps, warmup_num_steps)
    check_warmup_type(problems, warmup_type)


def check_lr_range_test(problems: ParamProblems, num_groups: int, lr_range_test_min_lr: Any,
                        lr_range_test_step_size: Any, lr_range_test_step_rate: Any,
                        lr_range_test_staircase: Any) -> list[float]:
    """LRRangeTest's values; returns the start lr of each param group."""
    min_lrs = per_group(problems, "lr_range_test_min_lr", lr_range_test_min_lr, num_groups)
    check_number(problems, "lr_range_test_step_size", lr_range_test_step_size, 0.0, positive=True)
    check_number(problems, "lr_range_test_step_rate", lr_range_test_step_rate, 0.0)
    if not isinstance(lr_range_test_staircase, bool):
        problems.add("lr_range_test_staircase", lr_range_test_staircase, "true or false",
                     "set lr_range_test_staircase to a boolean")
    return min_lrs


def check_one_cycle_shape(problems: ParamProblems, first_size: Any, second_size: Any, first_stairs: Any,
                          second_stairs: Any) -> tuple[float, float, int, int]:
    """OneCycle's cycle: returns (first_step_size, second_step_size, first_stair_count,
    second_stair_count) with the second half defaulting to the first."""
    check_number(problems, "cycle_first_step_size", first_size, 0.0, positive=True)
    if second_size is not None:
        check_number(problems, "cycle_second_step_size", second_size, 0.0, positive=True)
    check_int(problems, "cycle_first_stair_count", first_stairs, 0)
    if second_stairs is not None:
        check_int(problems, "cycle_second_stair_count", second_stairs, 0)
    first = float(first_size) if is_number(first_size) else 1.0
    second = float(second_size) if is_number(second_size) else first
    return (first, second, first_stairs, first_stairs if second_stairs is None else second_stairs)


def check_one_cycle(problems: ParamProblems, num_groups: int, params: dict[str, Any]
                    ) -> tuple[list[float], list[float], tuple[float, float, int, int]]:
    """OneCycle's values (`params`: every parameter of its row, defaults filled in); returns
    (min_lrs, max_lrs, cycle_shape)."""
    min_lrs = per_group(problems, "cycle_min_lr", params["cycle_min_lr"], num_groups)
    max_lrs = per_group(problems, "cycle_max_lr", params["cycle_max_lr"], num_groups)
    if any(hi < lo for lo, hi in zip(min_lrs, max_lrs)):
        problems.add("cycle_max_lr", params["cycle_max_lr"], f">= cycle_min_lr ({params['cycle_min_lr']})",
                     "swap cycle_min_lr and cycle_max_lr, or raise cycle_max_lr")
    cycle_shape = check_one_cycle_shape(problems, params["cycle_first_step_size"], params["cycle_second_step_size"],
                                        params["cycle_first_stair_count"], params["cycle_second_stair_count"])
    for key in ("decay_step_size", "decay_lr_rate", "decay_mom_rate"):
        check_number(problems, key, params[key], 0.0)
    min_mom, max_mom = params["cycle_min_mom"], params["cycle_max_mom"]
    check_number(problems, "cycle_min_mom", min_mom, 0.0, 1.0)
    check_number(problems, "cycle_max_mom", max_mom, 0.0, 1.0)
    if is_number(min_mom) and is_number(max_mom) and max_mom < min_mom:
        problems.add("cycle_max_mom", max_mom, f">= cycle_min_mom ({min_mom})", "swap cycle_min_mom and cycle_max_mom")
    return min_lrs, max_lrs, cycle_shape


def check_deepspeed_scheduler(type_name: str, params: dict[str, Any], group_lrs: list[float]) -> None:
    """Check `scheduler.params` of DeepSpeed scheduler `type_name` (whose keys are known to be its
    parameters, required ones present) for an optimizer whose groups hold `group_lrs`.
    Raises SchedulerParamsError naming every bad value, as the class would at construction."""
    values = {**DEEPSPEED_SCHEDULER_PARAMS[type_name], **params}
    problems = ParamProblems(type_name)
    if type_name in ("WarmupLR", "WarmupDecayLR"):
        check_warmup_lr(problems, group_lrs, values["warmup_min_lr"], values["warmup_max_lr"],
                        values["warmup_num_steps"], values["warmup_type"])
        if type_name == "WarmupDecayLR":
            check_total_steps(problems, values["total_num_steps"], values["warmup_num_steps"])
    elif type_name == "WarmupCosineLR":
        check_warmup_cosine_lr(problems, values["total_num_steps"], values["warmup_min_ratio"],
                               values["warmup_num_steps"], values["cos_min_ratio"], values["warmup_type"])
    elif type_name == "LRRangeTest":
        check_lr_range_test(problems, len(group_lrs), values["lr_range_test_min_lr"],
                            values["lr_range_test_step_size"], values["lr_range_test_step_rate"],
                            values["lr_range_test_staircase"])
    else:
        check_one_cycle(problems, len(group_lrs), values)
    problems.raise_if_any()
