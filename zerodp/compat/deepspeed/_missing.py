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


class PrivateClassNotBuilt(NotImplementedError):
    """A DeepSpeed-internal class was constructed; zerodp builds its own objects instead."""


def private_class(module_name: str, name: str, instead: str) -> type:
    """A class named like DeepSpeed's internal `name` in the mirror module `module_name`, for code that
    only imports it or tests `isinstance(x, name)`: no object zerodp builds is an instance (so the test is
    False, as it should be), and constructing one raises PrivateClassNotBuilt saying what zerodp uses
    `instead`."""
    path = f"{deepspeed_path(module_name)}.{name}"

    def __init__(self, *args: object, **kwargs: object) -> NoReturn:
        raise PrivateClassNotBuilt(f"{path} is DeepSpeed's internal class and is not provided by zerodp: "
                                   f"{instead}")

    doc = f"DeepSpeed's internal `{path}`: never built by zerodp ({instead})."
    return type(name, (), {"__init__": __init__, "__module__": module_name, "__doc__": doc})
