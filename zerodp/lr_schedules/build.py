"""The scheduler a config's `scheduler: {type, params}` names: one of DeepSpeed's five
(zerodp.lr_schedules.schedulers) or any torch.optim.lr_scheduler class.

    build_scheduler("WarmupDecayLR", {"total_num_steps": 10000, "warmup_num_steps": 500}, optimizer)
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from zerodp.config.schedulers import ParamProblems
from zerodp.lr_schedules.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    param_groups_owner,
)


DEEPSPEED_SCHEDULERS: dict[str, type] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _torch_scheduler_names() -> list[str]:
    module = torch.optim.lr_scheduler
    base = getattr(module, "LRScheduler", module._LRScheduler)
    return sorted(name for name, obj in vars(module).items()
                  if isinstance(obj, type) and issubclass(obj, base) and not name.startswith("_")
                  and name != "LRScheduler")


def _check_param_keys(type_name: str, cls: type, params: dict) -> None:
    signature = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    required = [name for name, p in signature.parameters.items()
                if name in accepted and p.default is inspect.Parameter.empty]
    problems = ParamProblems(type_name)
    for key in params:
        if key not in accepted:
            problems.add(key, params[key], f"a parameter of {type_name} ({', '.join(accepted)})",
                         f"remove {key} or correct its spelling")
    for key in required:
        if key not in params:
            problems.add(key, None, f"a value: {type_name} requires it", f"add {key} to scheduler.params")
    problems.raise_if_any()


def build_scheduler(type_name: str, params: dict | None, optimizer: Any) -> Any:
    """Construct the scheduler a config's `scheduler: {type, params}` names.

    The name is looked up among DeepSpeed's schedulers first (`DEEPSPEED_SCHEDULERS`), then among
    the classes of `torch.optim.lr_scheduler`; `params` are its keyword arguments.
    Raises ValueError for an unknown name (listing the valid ones) or unknown/missing params.
    """
    params = dict(params or {})
    cls = DEEPSPEED_SCHEDULERS.get(type_name)
    torch_names = _torch_scheduler_names()
    if cls is None and type_name in torch_names:
        cls = getattr(torch.optim.lr_scheduler, type_name)
        if not isinstance(optimizer, torch.optim.Optimizer):  # torch's schedulers need the real one
            optimizer = param_groups_owner(optimizer)
    if cls is None:
        valid = [*DEEPSPEED_SCHEDULERS, *torch_names]
        close = difflib.get_close_matches(str(type_name), valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"scheduler.type = {type_name!r} is neither a DeepSpeed scheduler "
                         f"({', '.join(DEEPSPEED_SCHEDULERS)}) nor a torch.optim.lr_scheduler class "
                         f"({', '.join(torch_names)}).{hint} Names are case-sensitive.")
    _check_param_keys(type_name, cls, params)
    return cls(optimizer, **params)
