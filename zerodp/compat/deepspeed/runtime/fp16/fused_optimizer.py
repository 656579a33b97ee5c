"""`deepspeed.runtime.fp16.fused_optimizer`: `FP16_Optimizer`, DeepSpeed's internal fp16 wrapper, by name
only: zerodp's engine keeps the fp32 master and the loss scale itself, and `engine.optimizer` is the
torch optimizer over them, so `isinstance(engine.optimizer, FP16_Optimizer)` is False and building one
is refused (zerodp._missing.private_class)."""

from zerodp.compat.deepspeed._missing import missing_attributes, private_class

FP16_Optimizer = private_class(__name__, "FP16_Optimizer", "zerodp's engine does the fp16 master weights and loss "
                               "scaling for any torch optimizer; pass the optimizer to deepspeed.initialize")

__all__ = ["FP16_Optimizer"]
__getattr__ = missing_attributes(__name__)
