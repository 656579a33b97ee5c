"""ZeRO strategies, one class per stage (see zero/base.py for the contract)."""

from __future__ import annotations

from zerodp.zero.base import Strategy
from zerodp.zero.stage0 import Stage0
from zerodp.zero.stage12 import Stage1, Stage2

_STRATEGIES: dict[int, type[Strategy]] = {0: Stage0, 1: Stage1, 2: Stage2}
_NOT_BUILT = {3: "ZeRO stage 3 (partitioned parameters) is not implemented yet (issue #4)"}

# Gradient-reduction keys whose non-default values no strategy honours yet: refused, not ignored.
_REDUCTION_DEFAULTS = {"gradient_allreduce_op": "mean", "prescale_gradients": False,
                       "gradient_predivide_factor": 1.0, "communication_data_type": None}


def strategy_class(config) -> type[Strategy]:
    """The Strategy for `config.zero_optimization`; NotImplementedError, with the reason, for what
    this version does not have yet (checked before any process communicates)."""
    zero = config.zero_optimization
    if zero.stage in _NOT_BUILT:
        raise NotImplementedError(f"{_NOT_BUILT[zero.stage]}; use zero_optimization.stage 0, 1 or 2")
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        if section is not None and section.device != "none":
            raise NotImplementedError(f"zero_optimization.{key}: offload is not implemented yet (issue #6)")
    for key, default in _REDUCTION_DEFAULTS.items():
        if getattr(config, key) != default:
            raise NotImplementedError(
                f"{key}={getattr(config, key)!r} is not implemented yet: zerodp averages gradients in the "
                f"accumulation dtype (data_types.grad_accum_dtype); remove the key or set it to {default!r}"
            )
    return _STRATEGIES[zero.stage]


__all__ = ["Stage0", "Stage1", "Stage2", "Strategy", "strategy_class"]
