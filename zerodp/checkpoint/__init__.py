"""Sharded, crash-safe checkpoints that load at any world size and stage (see format.py)."""

from zerodp.checkpoint.format import FORMAT_VERSION, CheckpointError
from zerodp.checkpoint.load import load_checkpoint
from zerodp.checkpoint.save import save_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointError", "load_checkpoint", "save_checkpoint"]
