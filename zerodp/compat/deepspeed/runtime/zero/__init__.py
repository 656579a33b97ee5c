"""`deepspeed.zero` (= `deepspeed.runtime.zero`): zero.Init, GatheredParameters and the stage-3 helpers."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.zero import offload_config, parameter_offload, partition_parameters
from zerodp.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "offload_config", "parameter_offload", "partition_parameters", "register_external_parameter"]
__getattr__ = missing_attributes(__name__)
