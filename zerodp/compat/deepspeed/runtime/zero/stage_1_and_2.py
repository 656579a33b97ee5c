"""`deepspeed.runtime.zero.stage_1_and_2`: `DeepSpeedZeroOptimizer`, DeepSpeed's internal ZeRO-1/2
optimizer, by name only: zerodp's stages are strategies of the engine (zerodp.zero.Stage1/Stage2) and
`engine.optimizer` is the torch optimizer over the shard, so `isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)` is False and building one is refused."""

from zerodp.compat.deepspeed._missing import missing_attributes, private_class

DeepSpeedZeroOptimizer = private_class(__name__, "DeepSpeedZeroOptimizer", "set zero_optimization.stage 1 or 2 in "
                                       "the config; the engine partitions the optimizer's state itself")

__all__ = ["DeepSpeedZeroOptimizer"]
__getattr__ = missing_attributes(__name__)
