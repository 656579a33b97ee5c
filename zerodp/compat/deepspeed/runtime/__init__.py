"""`deepspeed.runtime`: the engine, its config, ZeRO, LR schedules, activation checkpointing, sequence
parallelism, the repeating loader and utilities."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime import (activation_checkpointing, config, config_utils, dataloader, engine, fp16,
                                             lr_schedules, precision_config, sequence_parallel,
                                             sequence_tiled_compute, swap_tensor, utils, zero)

__all__ = ["activation_checkpointing", "config", "config_utils", "dataloader", "engine", "fp16", "lr_schedules",
           "precision_config", "sequence_parallel", "sequence_tiled_compute", "swap_tensor", "utils", "zero"]
__getattr__ = missing_attributes(__name__)
