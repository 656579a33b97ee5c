"""`deepspeed.ops.adam.cpu_adam`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.ops.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
__getattr__ = missing_attributes(__name__)
