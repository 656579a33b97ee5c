"""`deepspeed.utils.torch`: `required_torch_version`, the torch-version test DeepSpeed's code and tests use."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from zerodp.compat.deepspeed._missing import missing_attributes


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether this process's torch is at least `min_version` and at most `max_version` (either may be
    None, not both: ValueError)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    current = TorchVersion(torch.__version__)
    if min_version is not None and current < str(min_version):
        return False
    return max_version is None or current <= str(max_version)


__all__ = ["required_torch_version"]
__getattr__ = missing_attributes(__name__)
