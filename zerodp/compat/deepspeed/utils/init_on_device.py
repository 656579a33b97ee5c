"""`deepspeed.utils.init_on_device` (also `deepspeed.OnDevice`): build a module's tensors on a chosen
device and in a chosen floating-point dtype, the meta device included.

    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = MyModel()          # no memory: shapes and dtypes only (load weights later)

On torch's own mechanisms, so nothing global is patched: inside the block `torch.device(device)` is the
default device of every factory call (nn.Module's parameters included) and `dtype` the default
floating-point dtype. As in DeepSpeed, a constructor given an explicit `device=` keeps it; unlike
DeepSpeed's patched constructors, one given an explicit floating `dtype=` keeps it too (DeepSpeed casts
it), so a module that asks for fp32 on purpose (a norm's statistics) gets fp32.
"""

from __future__ import annotations

from types import TracebackType

import torch

from zerodp.compat.deepspeed._missing import missing_attributes


class OnDevice:
    """DeepSpeed's `OnDevice(dtype, device="meta", enabled=True)` context manager.

    Args:
        dtype: the floating-point dtype of tensors built without one (None: leave torch's default).
        device: where tensors built without a device go ("meta", "cpu", "cuda:0", a torch.device).
        enabled: False makes the block a no-op (DeepSpeed's switch for code that only sometimes wants it).
    """

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"OnDevice(dtype={dtype!r}): expected a floating-point torch.dtype "
                             "(torch.float32, torch.bfloat16, torch.float16) or None")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_context: torch.device | None = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        if self._device_context is not None:
            raise RuntimeError("OnDevice: this block is already entered; make a new OnDevice to nest one")
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        self._saved_dtype = torch.get_default_dtype()
        if self.dtype is not None:
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if not self.enabled or self._device_context is None:
            return
        torch.set_default_dtype(self._saved_dtype)
        self._device_context.__exit__(exc_type, exc, traceback)
        self._device_context = None


__all__ = ["OnDevice"]
__getattr__ = missing_attributes(__name__)
