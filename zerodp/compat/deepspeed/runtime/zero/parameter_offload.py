"""`deepspeed.runtime.zero.parameter_offload`: DeepSpeed's stage-3 parameter coordinator, as far as code
written for DeepSpeed reaches into it.

At stage 3 DeepSpeed's `engine.optimizer.parameter_offload` owns the module hooks that gather and release
parameters. TRL's `unwrap_model_for_generation` removes them (`forward_hooks`, `backward_hooks`) while
it generates inside `GatheredParameters(model.parameters())`, then registers them again
(`_register_deepspeed_module`). zerodp's engines built through `deepspeed.initialize` carry this object
on their optimizer at stage 3; its hooks are zerodp's own (Stage3.forward_hooks), removed and
reinstalled for real. zerodp has no backward module hooks (gradients are reduced from parameter hooks).
"""

from __future__ import annotations

from torch import nn

__all__ = ["DeepSpeedZeRoOffload"]


class DeepSpeedZeRoOffload:
    """The stage-3 strategy's forward hooks, under DeepSpeed's names."""

    def __init__(self, strategy) -> None:
        self._strategy = strategy
        self.backward_hooks: list = []  # never holds a handle
        self.module: nn.Module = strategy.module

    @property
    def forward_hooks(self) -> list:
        return self._strategy.forward_hooks

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:  # TRL empties the list after removing each handle
        self._strategy.forward_hooks = list(handles)

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Install the hooks again (after code that removed them, e.g. TRL's generation)."""
        if module is not self.module:
            raise ValueError("_register_deepspeed_module: zerodp installs its hooks on the engine's own module only")
        self._strategy.install_forward_hooks()


def attach(engine) -> None:
    """At stage 3, give the engine's optimizer DeepSpeed's `parameter_offload`, and the model DeepSpeed's
    `ds_external_parameters()` (what `register_external_parameter` declared on it)."""
    strategy = engine.strategy
    if not hasattr(strategy, "install_forward_hooks"):
        return
    engine.optimizer.parameter_offload = DeepSpeedZeRoOffload(strategy)
    module = strategy.module
    module.ds_external_parameters = lambda: [(str(id(p)), p) for p in module.__dict__.get("_zerodp_external_params", [])]
