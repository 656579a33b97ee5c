"""ZeRO strategies, one class per stage (see zero/base.py for the contract)."""

from __future__ import annotations

from zerodp.zero.base import Strategy
from zerodp.zero.stage0 import Stage0

_NOT_BUILT = {
    1: "ZeRO stage 1 (partitioned optimizer states) is not implemented yet (issue #3)",
    2: "ZeRO stage 2 (partitioned gradients) is not implemented yet (issue #3)",
    3: "ZeRO stage 3 (partitioned parameters) is not implemented yet (issue #4)",
}


def strategy_class(config) -> type[Strategy]:
    """The Strategy for `config.zero_optimization`; NotImplementedError, with the reason, for what
    this version does not have yet (checked before any process communicates)."""
    zero = config.zero_optimization
    if zero.stage in _NOT_BUILT:
        raise NotImplementedError(f"{_NOT_BUILT[zero.stage]}; set zero_optimization.stage to 0 for now")
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        if section is not None and str(getattr(section, "device", "none")) not in ("none", "OffloadDevice.none"):
            raise NotImplementedError(f"zero_optimization.{key}: offload is not implemented yet (issue #6)")
    return Stage0


__all__ = ["Strategy", "Stage0", "strategy_class"]
