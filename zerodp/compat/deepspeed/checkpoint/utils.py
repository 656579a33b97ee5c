"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`, and `get_model_ckpt_name_for_rank` (the
name of DeepSpeed's model-states file; zerodp reads folders in DeepSpeed's layout and writes its own,
docs/checkpoints.md, so in a folder zerodp wrote no such file exists)."""

from __future__ import annotations

import os
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


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file of model-parallel rank `mp_rank_str` ("00") in the tag folder
    `base_folder`: `<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]
__getattr__ = missing_attributes(__name__)
