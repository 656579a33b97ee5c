"""`deepspeed.runtime.utils`: `see_memory_usage` and `call_to_str`."""

from __future__ import annotations

import logging

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.accelerator import get_accelerator
from zerodp.log import log_rank0
from zerodp.sizes import format_bytes


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log (rank 0, zerodp's logger) `message` with the device's allocated and peak bytes, as DeepSpeed
    does; nothing unless `force` (DeepSpeed's default: scripts call it everywhere with force=False)."""
    if not force:
        return
    acc = get_accelerator()
    log_rank0("%s | %s allocated %s, peak %s", message, acc.device_name(), format_bytes(acc.memory_allocated()),
              format_bytes(acc.max_memory_allocated()), level=logging.WARNING)


def call_to_str(base: str, *args: object, **kwargs: object) -> str:
    """The call `base(*args, **kwargs)` written out: `call_to_str("f", 1, x="a")` is `f(1, x='a')`."""
    written = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(written)})"


__all__ = ["call_to_str", "see_memory_usage"]
__getattr__ = missing_attributes(__name__)
