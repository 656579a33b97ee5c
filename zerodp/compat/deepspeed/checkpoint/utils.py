"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`."""

from __future__ import annotations

from typing import Any

import torch

from zerodp.compat.deepspeed._missing import missing_attributes


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """`item` (a tensor, or lists / tuples / dicts of them) with every tensor copied to `device` and
    detached, so `torch.save` writes each tensor's own elements, not the whole storage it is a view of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
__getattr__ = missing_attributes(__name__)
