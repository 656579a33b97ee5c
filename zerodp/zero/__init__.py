"""ZeRO strategies, one class per stage (see zero/base.py for the contract)."""

from __future__ import annotations

from zerodp.zero.base import Strategy
from zerodp.zero.stage0 import Stage0
from zerodp.zero.stage12 import Stage1, Stage2
from zerodp.zero.stage3 import Stage3
from zerodp.zero.init import GatheredParameters, Init, is_partitioned
from zerodp.zero.units import (get_z3_leaf_modules, register_external_parameter, set_z3_leaf_modules,
                               set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                               z3_leaf_module)

_STRATEGIES: dict[int, type[Strategy]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

def strategy_class(config) -> type[Strategy]:
    """The Strategy for `config.zero_optimization.stage` (load_config has refused every
    combination no strategy implements)."""
    return _STRATEGIES[config.zero_optimization.stage]


__all__ = ["GatheredParameters", "Init", "Stage0", "Stage1", "Stage2", "Stage3", "Strategy", "is_partitioned", "register_external_parameter", "set_z3_leaf_modules",
           "strategy_class", "get_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module"]
