"""`deepspeed.runtime.zero.offload_config`: the offload sections as objects, and the enums scripts and
accelerate compare offload settings with.

`DeepSpeedZeroOffloadParamConfig(**section)` and `DeepSpeedZeroOffloadOptimizerConfig(**section)` are
zerodp's own schema for `offload_param` / `offload_optimizer` (zerodp.config): DeepSpeed 0.19.8's keys
and defaults, an unknown key an error naming it. `device` is a plain string that compares equal to
the enum (`config.device == OffloadDeviceEnum.cpu`), as DeepSpeed's `use_enum_values` models give.
"""

from enum import Enum

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.config import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from zerodp.config import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """Where `offload_optimizer.device` / `offload_param.device` put state."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The state groups `engine.offload_states(include=...)` names (DeepSpeed's values)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
__getattr__ = missing_attributes(__name__)
