"""`deepspeed.ops`: of DeepSpeed's kernels, the Adam optimizers (`deepspeed.ops.adam`) over torch's fused Adam;
the kernel builders (`op_builder`, `aio`), none of which compiles anything, and `__compatible_ops__`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.git_version_info import compatible_ops as __compatible_ops__
from zerodp.compat.deepspeed.ops import adam, aio, op_builder

__all__ = ["__compatible_ops__", "adam", "aio", "op_builder"]
__getattr__ = missing_attributes(__name__)
