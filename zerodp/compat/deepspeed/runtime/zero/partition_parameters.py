"""`deepspeed.runtime.zero.partition_parameters`: what transformers and TRL import from it.

zerodp's zero.Init casts each floating-point parameter to the config's dtype when it partitions it and
leaves torch's tensor constructors alone, so `zero_wrapper_for_fp_tensor_constructor` and the
`_orig_torch_*` names are here for code that wraps or compares them (transformers'
prevent_arange_dtype_change); zerodp's Init does not call the wrapper.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.accelerator import get_accelerator
from zerodp.zero import GatheredParameters, Init, register_external_parameter
from zerodp.zero.units import ZeroParamStatus  # what zerodp's stage-3 parameters carry as ds_status

_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: Any = None) -> Callable:
    """`fn` (a tensor constructor) that puts tensors on `target_device` unless a device is given and
    casts floating-point results to `target_fp_dtype` (DeepSpeed's semantics)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]
__getattr__ = missing_attributes(__name__)
