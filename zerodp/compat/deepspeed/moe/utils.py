"""`deepspeed.moe.utils`: `split_params_into_different_moe_groups_for_optimizer` and `is_moe_param`."""

from __future__ import annotations

from typing import Any

import torch

from zerodp.compat.deepspeed._missing import missing_attributes


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of a DeepSpeed MoE expert (DeepSpeed marks them `allreduce = False`)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None) -> list:
    """The param groups unchanged (as a list of group dicts): with no MoE expert parameters there is
    nothing to split. A DeepSpeed MoE expert parameter is refused (zerodp does not implement expert
    parallelism)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    for group in param_groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError("a DeepSpeed MoE expert parameter (allreduce=False) reached "
                                      "split_params_into_different_moe_groups_for_optimizer: zerodp does not "
                                      "implement expert parallelism")
    return param_groups


__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
__getattr__ = missing_attributes(__name__)
