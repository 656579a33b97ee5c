"""`deepspeed.runtime.zero.config`: the `zero_optimization` section as an object.

`DeepSpeedZeroConfig(**section)` is zerodp's own schema for the section (zerodp.config.ZeroConfig):
the same keys and defaults as DeepSpeed 0.19.8, a misspelled key an error naming it (DeepSpeed's model
forbids extra keys too), the stage-3 keys readable under both spellings
(`config.stage3_prefetch_bucket_size` and `config.prefetch_bucket_size`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                                 DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)
from zerodp.config import ZeroConfig as DeepSpeedZeroConfig

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what each partitions (DeepSpeed's names)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The `zero_optimization` section of a whole config dict (absent: every default, stage 0).
    DeepSpeed's old boolean form (`"zero_optimization": true`) is refused: zerodp's config reader
    names its replacement."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        raise ValueError(f'"{ZERO_OPTIMIZATION}": {str(section).lower()} is DeepSpeed\'s removed boolean form; '
                         f'write "{ZERO_OPTIMIZATION}": {{"stage": {int(section)}}}')
    return DeepSpeedZeroConfig(**section)


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZERO_OPTIMIZATION", "ZeroStageEnum", "get_zero_config"]
__getattr__ = missing_attributes(__name__)
