"""`deepspeed.runtime.zero.offload_config`: the enums scripts and accelerate compare offload settings with."""

from enum import Enum

from zerodp.compat.deepspeed._missing import missing_attributes


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


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
__getattr__ = missing_attributes(__name__)
