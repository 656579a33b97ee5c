"""Optimizers: from the config's `optimizer` section, a user instance, or a callable.

A strategy decides which tensors the optimizer updates (model parameters, fp32 masters, owned flat
shards); `optimizer_factory` turns whatever the user gave into a function from those param groups
to a torch optimizer, keeping the user's class, defaults and per-group hyperparameters.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch
from torch import nn

from zerodp.config.hparams import optimizer_class, optimizer_kwargs
from zerodp.log import logger
from zerodp.zero.base import OptimizerFactory


class NoOptimizer:
    """The optimizer of an engine that runs forward only (RLHF reference and reward models, evaluation
    before training): no param groups, no state. `reason` says why the engine has no optimizer."""

    zerodp_elementwise = True  # nothing is updated, so nothing can be cut wrongly: accepted at every stage

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.param_groups: list[dict] = []
        self.state: dict = {}
        self.defaults: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing holds gradients."""

    def step(self, closure: Any = None) -> None:
        raise RuntimeError(f"this engine runs forward only ({self.reason}): there is nothing to step")

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing to restore."""


def forward_only_reason(module: nn.Module, model_parameters: Iterable | None, optimizer: Any,
                        optimizer_config: Any) -> str | None:
    """Why initialize() builds a forward-only engine (None: it trains): no optimizer passed and none
    in the config, or no optimizer passed and every parameter frozen."""
    if optimizer is not None:
        return None
    if optimizer_config is None:
        return 'built without an optimizer: no optimizer= and no "optimizer" section in the config'
    if model_parameters is None and not any(p.requires_grad for p in module.parameters()):
        return "every parameter of the model is frozen"
    return None


def param_groups_from(
    module: nn.Module,
    model_parameters: Iterable | None,
    optimizer: torch.optim.Optimizer | None,
) -> list[dict]:
    """The user's param groups with only trainable parameters, empty groups dropped.

    Source, in order: the optimizer instance's groups, `model_parameters` (parameters or group
    dicts), else every `requires_grad` parameter of `module`.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        raw = [dict(g) for g in items] if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        raw = [{"params": list(module.parameters())}]
    groups, seen = [], set()
    for g in raw:
        params = [p for p in g["params"] if p.requires_grad]
        for p in params:
            if p in seen:
                raise ValueError("a parameter appears in more than one param group; give each parameter once")
            seen.add(p)
        if params:
            groups.append({**g, "params": params})
    if not groups:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    return groups


def optimizer_factory(optimizer: Any, optimizer_config: Any, device: torch.device) -> OptimizerFactory:
    """Turn initialize()'s `optimizer` argument (or the config section) into a factory.

    - an Optimizer instance: the same object is kept, its groups re-pointed at the strategy's
      tensors (so schedulers and user references keep working);
    - a callable: called with the strategy's param groups;
    - None: built from `optimizer_config` ({type, params}); with that missing too, initialize()
      builds a forward-only engine instead (`forward_only_reason`) and never asks for a factory.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return lambda groups: _repoint(optimizer, groups)
    if callable(optimizer):
        return optimizer
    if optimizer is not None:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a callable or None, got {type(optimizer).__name__}")
    return lambda groups: build_optimizer(optimizer_config.type, dict(optimizer_config.params), groups, device)


def _repoint(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """Point an existing optimizer's groups at new tensors, in place."""
    if any(_has_stepped(state) for state in optimizer.state.values()):
        raise ValueError(
            "the optimizer passed to initialize() already has state (it has stepped); pass a fresh "
            "optimizer and restore state with engine.load_checkpoint()"
        )
    optimizer.state.clear()  # initial state some optimizers make eagerly (Adagrad's sum) is remade lazily
    # param_groups_from dropped the groups with no trainable parameter, in order: match the rest.
    remaining = iter(groups)
    for group in optimizer.param_groups:
        trainable = any(p.requires_grad for p in group["params"])
        group["params"] = list(next(remaining)["params"]) if trainable else []
    return optimizer


def _has_stepped(state: dict) -> bool:
    step = state.get("step", 0)
    return float(step) > 0


def build_optimizer(type_name: str, params: dict, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    """Build torch's implementation of `type_name` over `groups`, fused where the device allows.
    `params` were checked by load_config (zerodp.config.hparams)."""
    cls = optimizer_class(type_name, params)
    if cls is None:
        raise ValueError(f"optimizer.type: unknown optimizer '{type_name}'; use Adam, AdamW, SGD, Adagrad or a "
                         "torch.optim class name")
    kwargs = optimizer_kwargs(cls, params)
    accepted = inspect.signature(cls.__init__).parameters
    if "fused" in accepted and "foreach" not in kwargs and "fused" not in kwargs:
        kwargs["fused"] = device.type in ("cuda", "cpu", "meta")  # meta: a simulated GPU
    logger.debug("optimizer %s(%s)", cls.__name__, kwargs)
    return cls(groups, **kwargs)
