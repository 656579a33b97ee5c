"""`deepspeed.runtime.config`: `DeepSpeedConfig`, the whole config as DeepSpeed's code and tests read it.

    config = DeepSpeedConfig("ds_config.json")            # or a dict; mpu= / mesh_device= as DeepSpeed's
    config.train_micro_batch_size_per_gpu, config.zero_optimization_stage, config.bfloat16_config.enabled

Built by zerodp's config loader (zerodp.config.load_config): the same checks `initialize` makes, every
problem reported at once as a `DeepSpeedConfigError` (zerodp's ConfigError, a ValueError), the batch
sizes resolved against the data-parallel world size as DeepSpeed resolves them. The attributes are
DeepSpeed's names over zerodp's sections; `zerodp_config` is the ZeroDPConfig itself.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp import comm
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.config import ConfigError as DeepSpeedConfigError
from zerodp.config import ZeroDPConfig, load_config
from zerodp.config.read import read_input
from zerodp.log import logger

# The optimizer names of the config's `optimizer.type` (lower case, as DeepSpeed compares them).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUON_OPTIMIZER = "muon"
MUSGD_OPTIMIZER = "musgd"

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SAME_NAMES = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
               "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "memory_breakdown",
               "dataloader_drop_last", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
               "disable_allgather", "dump_state", "gradient_allreduce_op")
"""Attributes DeepSpeed's config has under the config key's own name."""
_SECTIONS = {"zero_config": "zero_optimization", "float16_config": "fp16", "bfloat16_config": "bf16",
             "activation_checkpointing_config": "activation_checkpointing", "flops_profiler_config": "flops_profiler",
             "aio_config": "aio", "checkpoint_config": "checkpoint"}
"""DeepSpeed's attribute -> zerodp's section object."""


def _data_parallel_world_size(param_dict: dict[str, Any], mpu: Any, mesh_device: Any) -> int:
    """DeepSpeed's rule: the model-parallel unit's data-parallel size; else the size of the mesh's
    "data_parallel" dimension; else the process world size (1 without torch.distributed) divided by
    the sequence-parallel size."""
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return int(mpu.get_data_parallel_world_size())
        return comm.get_world_size() // int(mpu.get_sequence_parallel_world_size())
    if mesh_device is not None:
        return int(mesh_device.get_group(mesh_dim="data_parallel").size())
    world = comm.get_world_size() if comm.is_initialized() else 1
    return world // int(param_dict.get("sequence_parallel_size", 1) or 1)


class DeepSpeedConfig:
    """DeepSpeed's `DeepSpeedConfig(config, mpu=None, mesh_device=None)`.

    Args:
        config: a dict, or the path of a JSON file (a JSON string works too).
        mpu: a model-parallel unit; its `get_data_parallel_world_size()` is the world size the batch
            sizes are resolved against (DeepSpeed's use of it).
        mesh_device: a torch DeviceMesh with a "data_parallel" dimension, for the same purpose.
    Raises DeepSpeedConfigError naming every problem of the config.
    """

    def __init__(self, config: str | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        raw, _, _ = read_input(config, None)  # the world size depends on the file's sequence_parallel_size
        world_size = _data_parallel_world_size(raw, mpu, mesh_device)
        self.zerodp_config: ZeroDPConfig = load_config(config, world_size=world_size)
        self._param_dict: dict[str, Any] = raw
        self.global_rank = comm.get_rank() if comm.is_initialized() else 0
        self.world_size = world_size
        self._copy_attributes(self.zerodp_config)

    def _copy_attributes(self, cfg: ZeroDPConfig) -> None:
        """DeepSpeed's attribute names, each from zerodp's resolved section."""
        for name in _SAME_NAMES:
            setattr(self, name, getattr(cfg, name))
        for name, section in _SECTIONS.items():
            setattr(self, name, getattr(cfg, section))
        self.communication_data_type = _DTYPES.get(cfg.communication_data_type)
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.torch_autocast_enabled = cfg.torch_autocast.enabled
        self.torch_autocast_dtype = _DTYPES.get(cfg.torch_autocast.dtype)
        self.torch_autocast_lower_precision_safe_modules = cfg.torch_autocast.lower_precision_safe_modules
        optimizer, scheduler = cfg.optimizer, cfg.scheduler
        self.optimizer_name = optimizer.type.lower() if optimizer is not None else None
        self.optimizer_params = optimizer.params if optimizer is not None else None
        self.scheduler_name = scheduler.type if scheduler is not None else None
        self.scheduler_params = scheduler.params if scheduler is not None else None
        self.wall_clock_breakdown = cfg.wall_clock_breakdown or cfg.flops_profiler.enabled

    @property
    def fp16_enabled(self) -> bool:
        """The `fp16` section's switch (DeepSpeed before 0.17 had this attribute; 0.19 reads
        `float16_config.enabled`)."""
        return self.float16_config.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        """The `bf16` section's switch (older DeepSpeed's name for `bfloat16_config.enabled`)."""
        return self.bfloat16_config.enabled

    def print(self, name: str) -> None:
        """Log the resolved config under `name` (DeepSpeed's `config.print`) with zerodp's logger."""
        logger.info("%s:\n%s", name, self.zerodp_config.model_dump_json(indent=2, exclude_none=True))


__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DeepSpeedConfig", "DeepSpeedConfigError",
           "LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER",
           "MUSGD_OPTIMIZER"]
__getattr__ = missing_attributes(__name__)
