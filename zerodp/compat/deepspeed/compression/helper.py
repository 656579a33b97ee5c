"""`deepspeed.compression.helper`: `recursive_getattr` / `recursive_setattr`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
__getattr__ = missing_attributes(__name__)
