"""The curves of DeepSpeed's learning-rate schedulers as pure functions: numbers in, numbers out.

`iteration` is DeepSpeed's `last_batch_iteration` (see [Note: iteration numbering] in
zerodp/lr_schedules/schedulers.py): -1 before the first step, then 0, 1, 2, ...

    warmup_decay_lr(499, 0.0, 3e-4, warmup_num_steps=500, total_num_steps=10000)   # 3e-4: warmup's last step
"""

from __future__ import annotations

import math

from zerodp.config.schedulers import WARMUP_LINEAR, WARMUP_LOG, WARMUP_TYPES

__all__ = [
    "WARMUP_LINEAR", "WARMUP_LOG", "WARMUP_TYPES", "lr_range_test_lr", "one_cycle_lr", "one_cycle_momentum",
    "one_cycle_scale", "warmup_cosine_ratio", "warmup_decay_lr", "warmup_gamma", "warmup_lr",
]


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
