"""`deepspeed.utils.module_utils` (and `deepspeed.compression.helper`): dotted-name get/set on a module."""

from __future__ import annotations

import functools
from typing import Any

from zerodp.compat.deepspeed._missing import missing_attributes


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for module_name "a.b.c"."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for module_name "a.b.c"."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
__getattr__ = missing_attributes(__name__)
