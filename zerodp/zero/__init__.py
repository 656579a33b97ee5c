"""ZeRO strategies, one class per stage (see zero/base.py for the contract)."""

from __future__ import annotations

from zerodp.zero.base import Strategy
from zerodp.zero.stage0 import Stage0
from zerodp.zero.stage12 import Stage1, Stage2
from zerodp.zero.stage3 import Stage3
from zerodp.zero.init import GatheredParameters, Init, is_partitioned
from zerodp.zero.units import register_external_parameter, set_z3_leaf_modules

_STRATEGIES: dict[int, type[Strategy]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

# Gradient-reduction keys whose non-default values no strategy honours yet: refused, not ignored.
_REDUCTION_DEFAULTS = {"gradient_allreduce_op": "mean", "prescale_gradients": False,
                       "gradient_predivide_factor": 1.0, "communication_data_type": None}
# Stage-3 keys zerodp accepts at DeepSpeed's default only (docs/stage3.md says why).
_STAGE3_DEFAULTS = {"stage3_max_reuse_distance": (1_000_000_000, "units are not kept between calls"),
                    "stage3_module_granularity_threshold": (0, "units are chosen by module (set_z3_leaf_modules)"),
                    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are fetched with all-gather")}


def strategy_class(config) -> type[Strategy]:
    """The Strategy for `config.zero_optimization`; NotImplementedError, with the reason, for what
    this version does not have yet (checked before any process communicates)."""
    zero = config.zero_optimization
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        if section is None or section.device == "none":
            continue
        if zero.stage == 0:
            raise NotImplementedError(f"zero_optimization.{key} needs a ZeRO stage of 1-3 (stage is 0): set "
                                      '"stage": 1, 2 or 3, or remove the offload section')
        if getattr(section, "ratio", 1.0) != 1.0:
            raise NotImplementedError(f"zero_optimization.{key}.ratio={section.ratio}: partial offload is not "
                                      "implemented; remove the key (everything is offloaded)")
    for key, default in _REDUCTION_DEFAULTS.items():
        if getattr(config, key) != default:
            raise NotImplementedError(
                f"{key}={getattr(config, key)!r} is not implemented yet: zerodp averages gradients in the "
                f"accumulation dtype (data_types.grad_accum_dtype); remove the key or set it to {default!r}"
            )
    for key, (default, why) in _STAGE3_DEFAULTS.items():
        if zero.stage == 3 and getattr(zero, key) != default:
            raise NotImplementedError(f"zero_optimization.{key}={getattr(zero, key)!r} is not supported ({why}); "
                                      f"remove the key or set it to {default!r}")
    return _STRATEGIES[zero.stage]


__all__ = ["GatheredParameters", "Init", "Stage0", "Stage1", "Stage2", "Stage3", "Strategy", "is_partitioned", "register_external_parameter", "set_z3_leaf_modules",
           "strategy_class"]
