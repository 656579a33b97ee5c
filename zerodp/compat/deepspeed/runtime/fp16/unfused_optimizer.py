"""`deepspeed.runtime.fp16.unfused_optimizer`: `FP16_UnfusedOptimizer`, by name only (see
`deepspeed.runtime.fp16.fused_optimizer`)."""

from zerodp.compat.deepspeed._missing import missing_attributes, private_class

FP16_UnfusedOptimizer = private_class(__name__, "FP16_UnfusedOptimizer", "zerodp's engine does the fp16 master "
                                      "weights and loss scaling for any torch optimizer (LAMB included); pass "
                                      "the optimizer to deepspeed.initialize")

__all__ = ["FP16_UnfusedOptimizer"]
__getattr__ = missing_attributes(__name__)
