"""`deepspeed.moe.layer`: DeepSpeed's `MoE` layer, refused when built.

[Note: why MoE refuses rather than runs] DeepSpeed's MoE is more than a gate and experts: its
parameters are marked `allreduce=False` and reduced over expert-data-parallel groups, its gate has
capacity limits, token dropping, random token selection and noisy policies whose exact behaviour the
layer's output and `l_aux` depend on, and its checkpoints store experts in files of their own. An
ep_size=1 layer that matched only the constructor would give different numbers from DeepSpeed's
for the same seed and checkpoint differently — a layer that pretends. Until zerodp implements
mixture-of-experts, building one raises `MoENotProvided` naming the feature; importing the name works,
so model files that offer an MoE variant keep importing.
"""

from __future__ import annotations

from typing import Any

from zerodp.compat.deepspeed._missing import missing_attributes


class MoENotProvided(NotImplementedError):
    """DeepSpeed's mixture-of-experts layer was built; zerodp does not implement it."""

    def __init__(self, ep_size: Any, num_experts: Any) -> None:
        super().__init__(f"deepspeed.moe.layer.MoE(num_experts={num_experts}, ep_size={ep_size}): mixture-of-experts "
                         "layers (DeepSpeed's gate, experts and expert parallelism) are not implemented by zerodp; "
                         "use a dense layer, or DeepSpeed itself for MoE training")
        self.ep_size, self.num_experts = ep_size, num_experts

    def __reduce__(self) -> tuple:  # pickles with its arguments (DeepSpeed's test harness pools re-raise it)
        return type(self), (self.ep_size, self.num_experts)


class MoE:
    """`deepspeed.moe.layer.MoE(hidden_size, expert, num_experts=1, ep_size=1, k=1, ...)`: refused
    (see [Note: why MoE refuses rather than runs])."""

    def __init__(self, hidden_size: int, expert: Any, num_experts: int = 1, ep_size: int = 1,
                 *args: Any, **kwargs: Any) -> None:
        raise MoENotProvided(ep_size, num_experts)


__all__ = ["MoE", "MoENotProvided"]
__getattr__ = missing_attributes(__name__)
