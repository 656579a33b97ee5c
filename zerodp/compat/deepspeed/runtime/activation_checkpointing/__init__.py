"""`deepspeed.runtime.activation_checkpointing`."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
__getattr__ = missing_attributes(__name__)
