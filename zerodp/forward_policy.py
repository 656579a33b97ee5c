"""How the engine's forward runs: under torch.autocast (the `torch_autocast` section) and compiled
(`engine.compile()` or the `compile` section's torch.compile form).

The engine holds one `ForwardPolicy` and runs `self.module(...)` inside `policy.autocast()`; compiling
replaces nothing: `nn.Module.compile()` compiles the module's own call in place, so `engine.module`
stays the user's module (its state_dict, hooks and parameters unchanged) and every path that calls
it (the engine's forward, `engine.module.generate`) runs the compiled code, as with DeepSpeed.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from zerodp.config import ZeroDPConfig
from zerodp.log import log_rank0, warn_once

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

TORCH_COMPILE_KEYS = frozenset({"disable", "backend", "kwargs"})
"""The `compile` section's torch.compile form (DeepSpeed's compile examples, Axolotl's *_torch_compile.json)."""

DEFAULT_COMPILE_BACKEND = "inductor"
"""torch.compile's default backend, and DeepSpeed's (`get_accelerator().get_compile_backend()`) on CUDA and CPU."""

# [Note: torch_autocast]
# DeepSpeed 0.19's `torch_autocast` runs the engine's forward under torch.autocast(device, dtype) while
# the parameters, their gradients and the optimizer stay in fp32 (the bf16 / fp16 sections are the other
# way: 16-bit parameters with fp32 masters). zerodp does the same: the strategy sees fp32 parameters, so
# gradients are fp32 and reduced in fp32, and the loss is what a plain torch.autocast forward of the
# same model gives, bitwise. Two things DeepSpeed does that follow from it:
# - with the section off, an autocast the script opened around the engine's forward is switched off
#   inside it (DeepSpeed warns once and runs the forward in the parameters' dtype); the precision is
#   the config's, not the caller's;
# - `lower_precision_safe_modules` (default: Linear and Conv1d/2d/3d) names the module classes whose
#   gradients DeepSpeed reduces in the autocast dtype to halve their traffic. zerodp checks that each
#   name imports to an nn.Module class, as DeepSpeed does, and reduces every gradient in fp32: the
#   parameters and the update are the same, the all-reduce carries fp32 (twice the bytes of those
#   modules' gradients) and is exact where DeepSpeed's rounds them to the autocast dtype first.
# fp16 autocast needs a gradient scaler; zerodp builds its loss scaler for the fp16 section only, so
# the config check refuses torch_autocast with dtype fp16 (or unset: torch's CUDA default is fp16).

#
# [Note: compiling at stage 3]
# `engine.compile()` compiles the module's own call (nn.Module.compile), hooks included. Stage 3's
# module hooks gather and release parameters (collectives, storage swaps): they are marked
# torch.compiler.disable where they are registered (zerodp/zero/stage3_hooks.py), so dynamo calls them
# eagerly and compiles the compute between them, one graph per stretch between hooks, as DeepSpeed's
# disabled hooks give without DeepCompile. Stage 3 marks its root `_is_fsdp_managed_module` (for
# transformers' generate); dynamo then treats the module as FSDP's and refuses the whole frame unless
# the parameters are the module's own ("use_orig_params"), which zerodp's are (each a Parameter whose
# data the hooks swap): compile() says so with `_fsdp_use_orig_params`, and dynamo reads the
# parameters as graph inputs instead of constants.


def _module_class(name: str) -> type:
    """The class `package.module.Class` names (a ValueError naming it when it does not import)."""
    package, _, class_name = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(package), class_name) if package else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"torch_autocast.lower_precision_safe_modules: {name!r} does not import ({err}); expected "
                         "a module class by its full name, e.g. \"torch.nn.Linear\"") from None
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"torch_autocast.lower_precision_safe_modules: {name!r} is not an nn.Module class; "
                         "expected a module class by its full name, e.g. \"torch.nn.Linear\"")
    return found


class ForwardPolicy:
    """The engine forward's autocast and compilation state.

    Args:
        config: the resolved config (its `torch_autocast` and `compile` sections).
        module: the engine's module (compiled in place by `compile`).
        device: the device the engine trains on (autocast's device type).
    """

    def __init__(self, config: ZeroDPConfig, module: nn.Module, device: torch.device) -> None:
        section = config.torch_autocast
        self.device_type = device.type
        self.autocast_dtype: torch.dtype | None = _DTYPES[section.dtype] if section.enabled else None
        self.lower_precision_safe_classes = [_module_class(n) for n in section.lower_precision_safe_modules or []]
        if self.lower_precision_safe_classes:
            warn_once("torch_autocast.lower_precision_safe_modules: zerodp reduces these modules' gradients in "
                      "fp32, where DeepSpeed reduces them in the autocast dtype ([Note: torch_autocast])")
        self.module = module
        self.is_compiled = False
        self.compile_backend: str | None = None
        self.compile_kwargs: dict[str, Any] = {}

    def autocast(self) -> AbstractContextManager[Any]:
        """The context the module's forward runs in ([Note: torch_autocast])."""
        if self.autocast_dtype is not None:
            return torch.autocast(self.device_type, dtype=self.autocast_dtype)
        # a device autocast does not know (the estimator's simulated one, meta) has no autocast to switch off
        if torch.amp.is_autocast_available(self.device_type) and torch.is_autocast_enabled(self.device_type):
            warn_once("torch.autocast is enabled around the engine's forward but the config's torch_autocast "
                      "section is off: the forward runs without autocast, as with DeepSpeed (set "
                      "torch_autocast.enabled to run it under autocast)")
            return torch.autocast(self.device_type, enabled=False)
        return nullcontext()

    def compile(self, backend: str | Any = DEFAULT_COMPILE_BACKEND, compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the module in place with torch.compile (DeepSpeed's `engine.compile`); a second
        call is a no-op. `schedule` (DeepCompile's pass schedule) and `compiled_autograd_enabled` are
        refused: zerodp's ZeRO runs in module and gradient hooks, outside the compiled graph."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile schedules are not supported by "
                                      "zerodp (its ZeRO stages run eagerly around the compiled module); leave "
                                      "schedule=None")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                                      "supported by zerodp (its gradient hooks reduce during backward); leave it "
                                      "False: the forward is compiled, backward runs its compiled graph anyway")
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            warn_once("engine.compile: `backend` in compile_kwargs is overridden by the backend argument "
                      "(as DeepSpeed does)")
            kwargs.pop("backend")
        if self.is_compiled:
            return
        for module in self.module.modules():
            if getattr(module, "_is_fsdp_managed_module", False):  # [Note: compiling at stage 3]
                module._fsdp_use_orig_params = True
        self.module.compile(backend=backend, **kwargs)
        self.is_compiled = True
        self.compile_backend, self.compile_kwargs = backend, kwargs
        log_rank0("compiled the module with torch.compile (backend=%s)", backend)


def compile_from_config(policy: ForwardPolicy, section: dict[str, Any] | None) -> None:
    """Compile as the `compile` section's torch.compile form asks: `{"disable": false, "backend": ...,
    "kwargs": {...}}` compiles (backend default "inductor"); absent, `disable: true`, or only DeepSpeed
    0.19's DeepCompile keys: nothing (DeepSpeed 0.19 compiles only when the script calls engine.compile())."""
    if not section or not TORCH_COMPILE_KEYS & section.keys() or section.get("disable") is True:
        return
    policy.compile(section.get("backend", DEFAULT_COMPILE_BACKEND), section.get("kwargs") or {})
