"""`deepspeed.compression`: of DeepSpeed's compression library, only `helper`'s dotted-name utilities."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.compression import helper

__all__ = ["helper"]
__getattr__ = missing_attributes(__name__)
