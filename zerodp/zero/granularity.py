"""`zero_optimization.stage3_module_granularity_threshold`: make fine-grained modules stage-3 units.

[Note: module granularity]
DeepSpeed's key marks as leaf modules (zerodp: units, zero/units.py's [Note: choosing units]) the
outermost modules whose *granularity*, parameters per layer, is at most the threshold, so a block
of many small layers is gathered with one collective instead of one per layer. A module's layers are
the parameterized modules without children in its subtree, plus the module itself; its parameters
are its own plus its children's (as summed child by child). Modules without parameters, modules
without children and the torch containers (ModuleList, Sequential, ...) are never marked: a
container's forward may not run, so its children must keep their own units; nor is a module of
more than 1e9 parameters, whose gathered copy would cost more than the collectives it saves. When
no module is fine-grained enough, nothing changes and one warning names the smallest granularity.
The marking is an optimization only: the losses are the same with and without it (DeepSpeed's own
test_finegrained_optimization checks that, and passes on zerodp).
"""

from __future__ import annotations

import math

from torch import nn
from torch.nn.modules import container

from zerodp.log import logger
from zerodp.zero.units import full_numel, set_z3_leaf_modules_by_name

MAX_LEAF_NUMEL = 10**9
"""A module with more parameters than this is never marked (see [Note: module granularity])."""


def module_granularity(model: nn.Module) -> dict[nn.Module, float]:
    """Parameters per layer of every module of `model` (math.inf: never marked)."""
    granularity: dict[nn.Module, float] = {}

    def visit(module: nn.Module) -> tuple[int, int]:  # (layers, parameters) of the subtree
        if next(module.parameters(), None) is None:
            granularity[module] = math.inf
            return 0, 0
        numel = sum(full_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            granularity[module] = math.inf
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = visit(child)
            layers, numel = layers + child_layers, numel + child_numel
        if type(module).__name__ in container.__all__:
            granularity[module] = math.inf
            return layers, numel
        layers += 1
        granularity[module] = numel // layers if numel <= MAX_LEAF_NUMEL else math.inf
        return layers, numel

    visit(model)
    return granularity


def mark_leaf_modules_by_granularity(model: nn.Module, threshold: int) -> list[str]:
    """Mark the outermost modules of granularity <= `threshold` as units; returns their names ("" is
    the model itself). Nothing, with one warning, when no module qualifies."""
    granularity = module_granularity(model)
    finest = min(granularity, key=granularity.__getitem__)
    if granularity[finest] > threshold:
        logger.warning("zero_optimization.stage3_module_granularity_threshold=%d marks no module: the finest "
                       "module is %s with %s parameters per layer; set at least that to mark it", threshold,
                       type(finest).__name__, granularity[finest])
        return []
    names: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        if granularity[module] <= threshold:
            names.append(name)
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    set_z3_leaf_modules_by_name(model, names)
    logger.info("zero_optimization.stage3_module_granularity_threshold=%d: %d module(s) made units: %s", threshold,
                len(names), ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else ""))
    return names
