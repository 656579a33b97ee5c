"""`deepspeed.zero` (= `deepspeed.runtime.zero`): zero.Init, GatheredParameters, the stage-3 helpers and the
`zero_optimization` config classes."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.zero import (config, leaf_module_config, offload_config, parameter_offload,
                                                  partition_parameters, stage3, stage_1_and_2)
from zerodp.compat.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from zerodp.zero import GatheredParameters, Init, register_external_parameter
from zerodp.zero.units import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "config", "leaf_module_config", "offload_config",
           "parameter_offload", "partition_parameters", "register_external_parameter", "stage3", "stage_1_and_2",
           "unwrap_model_for_generation"]
__getattr__ = missing_attributes(__name__)
