"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is zerodp's Engine (isinstance checks hold), and the
engine methods DeepSpeed has that `deepspeed.initialize` adds to zerodp's engines (`attach`)."""

from __future__ import annotations

import gc
import types
from typing import Any

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.accelerator import get_accelerator
from zerodp.engine import Engine as DeepSpeedEngine


def empty_partition_cache(engine: Any) -> None:
    """DeepSpeed's `engine.empty_partition_cache()`: free what stage 3 holds gathered between passes.

    zerodp's stage 3 keeps no gathered unit between passes (each is released after its use), so there
    is none to free; what remains of DeepSpeed's call is collecting garbage and returning the
    accelerator's cached blocks, which this does."""
    gc.collect()
    get_accelerator().empty_cache()


def attach(engine: DeepSpeedEngine) -> None:
    """Give `engine` the DeepSpeed engine methods above (bound to it)."""
    engine.empty_partition_cache = types.MethodType(empty_partition_cache, engine)


__all__ = ["DeepSpeedEngine", "attach", "empty_partition_cache"]
__getattr__ = missing_attributes(__name__)
