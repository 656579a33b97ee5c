"""`deepspeed.runtime.precision_config`: the `fp16` and `bf16` sections as objects.

`DeepSpeedBF16Config` is zerodp's own `bf16` schema (zerodp.config.BF16Config). `DeepSpeedFP16Config`
is zerodp's `fp16` schema with DeepSpeed 0.19.8's rules for a section built directly: a number given
as a string ("3") is read as that number, a bool is never a number, and the dynamic-scaling values
(`loss_scale_window`, `min_loss_scale`) must be > 0 only when dynamic scaling is on (enabled and
loss_scale 0). Each refusal is a pydantic ValidationError naming the key.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ConfigDict, ValidationInfo, field_validator, model_validator

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.config import BF16Config as DeepSpeedBF16Config
from zerodp.config import FP16Config

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"


class DeepSpeedFP16Config(FP16Config):
    """`fp16` with DeepSpeed's value rules (see the module docstring); fields and defaults are zerodp's
    FP16Config's, which are DeepSpeed's."""

    model_config = ConfigDict(strict=False)  # DeepSpeed's model converts "3" -> 3.0

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_is_a_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"fp16.loss_scale must be a number, not a bool ({value}); 0 is dynamic scaling")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"fp16.loss_scale must be a number; got {value!r}") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"fp16.loss_scale must be a finite number >= 0 (0 is dynamic scaling); got {value!r}")
        return number

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _an_integer(cls, value: Any, info: ValidationInfo) -> Any:
        where = f"fp16.{info.field_name}"
        if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{where} must be a finite integer; got {value!r}")
        try:
            int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be an integer; got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_values(self) -> "DeepSpeedFP16Config":
        if self.enabled and self.loss_scale == 0:
            for name in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"fp16.{name} must be > 0 with dynamic loss scaling (fp16.loss_scale 0); "
                                     f"got {getattr(self, name)}")
        return self

    def initial_dynamic_scale(self) -> int:
        """The first dynamic loss scale, 2**initial_scale_power."""
        return 2**self.initial_scale_power


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The `bf16` section (or its old name `bfloat16`) of a whole config dict."""
    section = param_dict.get(BFLOAT16)
    return DeepSpeedBF16Config(**(section if section is not None else param_dict.get(BFLOAT16_OLD, {})))


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The `fp16` section of a whole config dict."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


__all__ = ["BFLOAT16", "BFLOAT16_OLD", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "FP16", "get_bfloat16_config",
           "get_float16_config"]
__getattr__ = missing_attributes(__name__)
