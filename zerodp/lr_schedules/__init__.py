"""DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest) with DeepSpeed's names, parameters, defaults and curves, and the builder that turns a
config's `scheduler: {type, params}` into one of them or a torch.optim.lr_scheduler class.

    curves.py      the curves as pure functions (numbers in, numbers out)
    schedulers.py  the classes: iteration counter, param groups written, state_dict
    build.py       DEEPSPEED_SCHEDULERS and build_scheduler

Their parameters and the checks on their values are zerodp.config.schedulers', so that the config
(the layer below) validates `scheduler.params` without importing this package.
"""

from zerodp.config.schedulers import SchedulerParamsError
from zerodp.lr_schedules.build import DEEPSPEED_SCHEDULERS, build_scheduler
from zerodp.lr_schedules.curves import (
    WARMUP_LINEAR,
    WARMUP_LOG,
    WARMUP_TYPES,
    lr_range_test_lr,
    one_cycle_lr,
    one_cycle_momentum,
    one_cycle_scale,
    warmup_cosine_ratio,
    warmup_decay_lr,
    warmup_gamma,
    warmup_lr,
)
from zerodp.lr_schedules.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "DEEPSPEED_SCHEDULERS", "LRRangeTest", "OneCycle", "SchedulerParamsError", "WARMUP_LINEAR", "WARMUP_LOG",
    "WARMUP_TYPES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler", "lr_range_test_lr",
    "one_cycle_lr", "one_cycle_momentum", "one_cycle_scale", "warmup_cosine_ratio", "warmup_decay_lr",
    "warmup_gamma", "warmup_lr",
]
