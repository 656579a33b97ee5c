"""`deepspeed.accelerator`: `get_accelerator()`, the device facade DeepSpeed scripts and transformers call.

One object for the device zerodp trains on (CUDA when available, else the CPU), answering DeepSpeed's
questions with torch's answers. On the CPU, memory_allocated() is the process's resident memory and
max_memory_allocated() its peak (what DeepSpeed's CPU accelerator reports too).
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from zerodp.compat.deepspeed._missing import missing_attributes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Accelerator:
    """DeepSpeed's accelerator interface for the device this process uses ("cuda" or "cpu")."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._cuda = self._name == "cuda"
        self._cpu_peak_bytes: int | None = None  # on the CPU: the largest RSS seen since a reset (None: no reset)

    def device_name(self, device_index: int | str | None = None) -> str:
        """"cuda" or "cuda:N" (device_index given), "cpu" on the CPU."""
        return f"cuda:{device_index}" if self._cuda and device_index is not None else self._name

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int | str) -> None:
        if self._cuda:
            torch.cuda.set_device(int(device_index))

    def device_count(self) -> int:
        """CUDA's count; on the CPU, DeepSpeed's `LOCAL_SIZE` when set above 0 (its CPU accelerator's
        override), else the launcher's LOCAL_WORLD_SIZE, else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        local_size = os.environ.get("LOCAL_SIZE", "")
        if local_size.isdigit() and int(local_size) > 0:
            return int(local_size)
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _rss_bytes()
        if self._cpu_peak_bytes is not None:
            self._cpu_peak_bytes = max(self._cpu_peak_bytes, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        now = self.memory_allocated()
        if self._cpu_peak_bytes is None:  # the kernel's high-water mark of the process (kB on Linux)
            return max(now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return self._cpu_peak_bytes

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._cpu_peak_bytes = _rss_bytes()

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def use_host_timers(self) -> bool:
        return not self._cuda

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def __getattr__(self, name: str) -> Any:
        from _zerodp_as_deepspeed import AttributeNotProvided

        raise AttributeNotProvided(f"deepspeed.accelerator.get_accelerator().{name}")


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (made on first use, so CUDA is probed only when asked)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator()
    return _accelerator


def is_current_accelerator_supported() -> bool:
    """Whether DeepSpeed supports the accelerator in use: True, since zerodp's is CUDA or the CPU, both
    in DeepSpeed's list (DeepSpeed's test harness asks before it runs anything)."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]
__getattr__ = missing_attributes(__name__)
