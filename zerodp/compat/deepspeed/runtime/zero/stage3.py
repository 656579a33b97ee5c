"""`deepspeed.runtime.zero.stage3`: `unwrap_model_for_generation`, the one name code outside DeepSpeed
imports from it (TRL and RLHF loops generate with the trained engine), and `DeepSpeedZeroOptimizer_Stage3`
by name only (zerodp's stage 3 is a strategy of the engine; `engine.optimizer` is the torch optimizer)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from zerodp.compat.deepspeed._missing import missing_attributes, private_class
from zerodp.zero import GatheredParameters


@contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Gather every stage-3 parameter of `model` (an engine, or the module it wraps) once for the
    block, so each forward of a `generate()` inside it gathers nothing; yields `model` itself.

    DeepSpeed also removes its module hooks for the block and puts them back after. zerodp keeps its
    hooks: a no-grad forward over units that GatheredParameters holds is a HELD pass, in which the
    hooks neither gather nor release anything (docs/architecture.md, PassKind). At stages 0-2 the
    parameters are whole already and the block changes nothing. Every rank must enter it (the gather
    is a collective), and a training step inside it is an error, as inside GatheredParameters.
    """
    with GatheredParameters(list(model.parameters())):
        yield model


DeepSpeedZeroOptimizer_Stage3 = private_class(__name__, "DeepSpeedZeroOptimizer_Stage3", "set "
                                              "zero_optimization.stage 3 in the config; the engine partitions "
                                              "parameters, gradients and optimizer state itself")

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]
__getattr__ = missing_attributes(__name__)
