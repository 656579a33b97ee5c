"""`deepspeed.utils.zero_to_fp32`: DeepSpeed's three consolidation functions and its command line,
reading zerodp checkpoints and DeepSpeed's own checkpoint folders.

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")   # the `latest` tag

    ZERODP_AS_DEEPSPEED=1 python -m deepspeed.utils.zero_to_fp32 checkpoints out/ [--safe_serialization]
    python checkpoints/zero_to_fp32.py checkpoints out/       # the script save_checkpoint writes there

The command line and the conversion to files are zerodp.cli.zero_to_fp32's (the script save_checkpoint
writes runs it without the switch). They stream from the sharded checkpoint as `zerodp ckpt convert`
does (zerodp.checkpoint.convert): memory stays near one output shard, never the whole model per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from zerodp.checkpoint.convert import load_state_dict_from_checkpoint
from zerodp.cli.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict, main, refuse_unsupported
from zerodp.compat.deepspeed._missing import missing_attributes


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (on the CPU) of the checkpoint in `checkpoint_dir` (tag: default the
    `latest` one). exclude_frozen_parameters and lazy_mode are refused (see refuse_unsupported)."""
    refuse_unsupported("get_fp32_state_dict_from_zero_checkpoint", exclude_frozen_parameters, lazy_mode)
    return load_state_dict_from_checkpoint(checkpoint_dir, tag, dtype=torch.float32)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (on the CPU, strict=False as DeepSpeed) and
    return it: for use after training, not on an engine's model."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "main"]
__getattr__ = missing_attributes(__name__)


if __name__ == "__main__":
    sys.exit(main())
