"""`deepspeed.ops.adam.fused_adam`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.ops.adam import FusedAdam

__all__ = ["FusedAdam"]
__getattr__ = missing_attributes(__name__)
