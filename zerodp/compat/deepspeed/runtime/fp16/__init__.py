"""`deepspeed.runtime.fp16`: DeepSpeed's fp16 optimizer wrappers, by name only (see `fused_optimizer`)."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.fp16 import fused_optimizer, unfused_optimizer

__all__ = ["fused_optimizer", "unfused_optimizer"]
__getattr__ = missing_attributes(__name__)
