"""`deepspeed.utils.tensor_fragment`: DeepSpeed's public tensor-fragment API (`safe_get_full_fp32_param`,
`safe_get_full_grad`, `safe_get_full_optimizer_state`, `safe_set_full_*`, `safe_get_local_*`,
`safe_set_local_*`, `safe_update_full_grad_vectorized`), implemented by zerodp.zero.fragments at every
stage (see its [Note: fragments and collectives]). DeepSpeed's internal mapping helpers
(`tensor_fragment`, `get_hp_fragment_mapping`, ...) are not provided."""

from __future__ import annotations

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.zero.fragments import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                   safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                                   safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                                   safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                                   safe_update_full_grad_vectorized)

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
__getattr__ = missing_attributes(__name__)
