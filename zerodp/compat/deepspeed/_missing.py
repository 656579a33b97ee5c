"""The module `__getattr__` every mirrored DeepSpeed module ends with: an attribute DeepSpeed has and
zerodp does not raises an AttributeError naming the DeepSpeed path (hasattr() stays False)."""

from __future__ import annotations

from typing import Callable, NoReturn

from _zerodp_as_deepspeed import TARGET, AttributeNotProvided


def deepspeed_path(module_name: str) -> str:
    """`zerodp.compat.deepspeed.X` -> `deepspeed.X` (the name a DeepSpeed user wrote)."""
    return "deepspeed" + module_name[len(TARGET):]


def missing_attributes(module_name: str) -> Callable[[str], NoReturn]:
    """A module-level `__getattr__` for the mirror module `module_name`."""
    path = deepspeed_path(module_name)

    def __getattr__(name: str) -> NoReturn:
        raise AttributeNotProvided(f"{path}.{name}")

    return __getattr__
