"""`deepspeed.moe`: zerodp has no mixture-of-experts layers (`layer.MoE` refuses when built); `utils` keeps
scripts that split groups working."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
__getattr__ = missing_attributes(__name__)
