"""`deepspeed.ops.aio`: DeepSpeed's async-I/O op builder, not compatible here (zerodp's NVMe offload
uses its own file I/O; see deepspeed.ops.op_builder)."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
__getattr__ = missing_attributes(__name__)
