"""`deepspeed.ops`: of DeepSpeed's kernels, the Adam optimizers (`deepspeed.ops.adam`) over torch's fused Adam."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.ops import adam

__all__ = ["adam"]
__getattr__ = missing_attributes(__name__)
