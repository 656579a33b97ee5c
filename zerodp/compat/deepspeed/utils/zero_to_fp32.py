"""`deepspeed.utils.zero_to_fp32`: DeepSpeed's three consolidation functions, reading zerodp checkpoints.

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")   # the `latest` tag

They stream from the sharded checkpoint as `zerodp ckpt convert` does (zerodp.checkpoint.convert): memory
stays near one output shard, never the whole model per rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from zerodp.checkpoint.convert import convert_to_safetensors, convert_to_torch, load_state_dict_from_checkpoint
from zerodp.compat.deepspeed._missing import missing_attributes


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (on the CPU) of the checkpoint in `checkpoint_dir` (tag: default the
    `latest` one). exclude_frozen_parameters and lazy_mode are refused (see _refuse)."""
    _refuse("get_fp32_state_dict_from_zero_checkpoint", exclude_frozen_parameters, lazy_mode)
    return load_state_dict_from_checkpoint(checkpoint_dir, tag, dtype=torch.float32)


def _refuse(function: str, exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(f"{function}(exclude_frozen_parameters=True) is not supported by zerodp: a zerodp "
                                  "checkpoint keeps frozen parameters beside buffers; save without them instead "
                                  "(engine.save_checkpoint(dir, exclude_frozen_parameters=True))")
    if lazy_mode:
        raise NotImplementedError(f"{function}(lazy_mode=True) is not supported by zerodp: it returns materialised "
                                  "tensors; `zerodp ckpt convert` streams a large model to disk one tensor at a time")


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (on the CPU, strict=False as DeepSpeed) and
    return it: for use after training, not on an engine's model."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the checkpoint's fp32 weights to `output_dir` as `pytorch_model*.bin` (or, with
    safe_serialization, `model*.safetensors`) shards of at most `max_shard_size` plus an index, as
    DeepSpeed does; returns the files written."""
    _refuse("convert_zero_checkpoint_to_fp32_state_dict", exclude_frozen_parameters)
    from zerodp.sizes import parse_size

    size = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    write = convert_to_safetensors if safe_serialization else convert_to_torch
    return write(checkpoint_dir, output_dir, tag, torch.float32, size)


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
__getattr__ = missing_attributes(__name__)
