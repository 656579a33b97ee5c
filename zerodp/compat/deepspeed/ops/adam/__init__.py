"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam, as torch's fused Adam / AdamW with their arguments.

DeepSpeed's two classes are CUDA and C++ kernels of the same update torch's fused Adam computes (on this
machine's CPU torch's fused AdamW takes 34.4 ms per 50M elements, DeepSpeed's CPUAdam 30.7 ms:
`python bench/cpu_adam.py`, bench/README.md). Both are
element-wise, so zerodp accepts them at every stage and with offload; an argument torch cannot honour is
refused by name.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerodp.compat.deepspeed._missing import missing_attributes


def _fused_adam_kwargs(owner: str, bias_correction: bool, adamw: bool) -> dict[str, Any]:
    if not bias_correction:
        raise ValueError(f"{owner}(bias_correction=False) is not supported by zerodp: torch's fused Adam always "
                         "corrects bias; remove the argument or pass True")
    return {"decoupled_weight_decay": adamw, "fused": True}


class FusedAdam(torch.optim.Adam):
    """`deepspeed.ops.adam.FusedAdam`: Adam (adam_w_mode=False: L2 weight decay) or AdamW (the default),
    torch's fused kernel.

    Args (DeepSpeed's): params, lr=1e-3, bias_correction=True (False is refused), betas=(0.9, 0.999),
        eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True (zero_grad()
        sets gradients to None, torch's default).
    """

    zerodp_elementwise = True  # the update of an element reads only that element's history

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **_fused_adam_kwargs("FusedAdam", bias_correction, adam_w_mode))
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """`deepspeed.ops.adam.DeepSpeedCPUAdam`: the same update as FusedAdam (torch's fused kernel, on
    whatever device the optimizer's tensors are: the host when offload_optimizer moves them there).

    Args (DeepSpeed's): model_params, lr=1e-3, bias_correction=True (False is refused),
        betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
        fp32_optimizer_states=True (False is refused: use zerodp's bf16 optimizer-state option instead).
    """

    zerodp_elementwise = True

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported by zerodp: the "
                             "optimizer state follows the config (\"bf16\": {\"bf16_master_weights_and_grads\": true, "
                             "\"bf16_optimizer_states\": true} keeps it in bf16); remove the argument")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **_fused_adam_kwargs("DeepSpeedCPUAdam", bias_correction, adamw_mode))


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
__getattr__ = missing_attributes(__name__)
