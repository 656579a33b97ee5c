"""`deepspeed.runtime.utils`: `see_memory_usage`."""

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


__all__ = ["see_memory_usage"]
__getattr__ = missing_attributes(__name__)
