"""`deepspeed.checkpoint`: of DeepSpeed's checkpoint tools, `utils.clone_tensors_for_torch_save`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.checkpoint import utils

__all__ = ["utils"]
__getattr__ = missing_attributes(__name__)
