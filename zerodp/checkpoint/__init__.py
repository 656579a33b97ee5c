"""Sharded, crash-safe checkpoints that load at any world size and stage (see format.py)."""

from zerodp.checkpoint.convert import (convert_to_safetensors, convert_to_torch, load_state_dict_from_checkpoint,
                                       read_safetensors)
from zerodp.checkpoint.format import FORMAT_VERSION, CheckpointError
from zerodp.checkpoint.load import load_checkpoint
from zerodp.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "convert_to_safetensors",
    "convert_to_torch",
    "load_checkpoint",
    "load_state_dict_from_checkpoint",
    "read_safetensors",
    "save_checkpoint",
]
