"""`deepspeed.pipe`: the names of DeepSpeed's pipeline-parallel API, each refusing when used.

zerodp is data-parallel only (ZeRO stages 0-3); it does not build pipeline parallelism. The classes are
here so that code which merely imports them (a model file that also offers a pipeline variant, DeepSpeed's
own test helpers) keeps importing; building a `PipelineModule`, `LayerSpec` or `TiedLayerSpec` raises
`PipelineParallelismNotProvided` naming the feature. Subclassing is allowed (a class statement builds
nothing); constructing the subclass is what refuses.
"""

from __future__ import annotations

from typing import Any, NoReturn

from zerodp.compat.deepspeed._missing import missing_attributes


class PipelineParallelismNotProvided(NotImplementedError):
    """DeepSpeed's pipeline parallelism (`deepspeed.pipe`) was used; zerodp does not implement it."""

    def __init__(self, name: str) -> None:
        super().__init__(f"deepspeed.pipe.{name}: pipeline parallelism is not implemented by zerodp (it is "
                         "data-parallel only, ZeRO stages 0-3); build the model as a plain torch.nn.Module "
                         "(e.g. torch.nn.Sequential of the layers) and train it with ZeRO, or use DeepSpeed "
                         "itself for pipeline parallelism")
        self.name = name

    def __reduce__(self) -> tuple:
        return type(self), (self.name,)


def _refuse(name: str) -> NoReturn:
    raise PipelineParallelismNotProvided(name)


class LayerSpec:
    """`deepspeed.pipe.LayerSpec(typename, *args, **kwargs)`: refused (pipeline parallelism)."""

    def __init__(self, typename: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(type(self).__name__)


class TiedLayerSpec(LayerSpec):
    """`deepspeed.pipe.TiedLayerSpec(key, typename, *args, ...)`: refused (pipeline parallelism)."""


class PipelineModule:
    """`deepspeed.pipe.PipelineModule(layers, num_stages=None, ...)`: refused (pipeline parallelism).

    A plain class rather than a torch.nn.Module subclass, so that nothing of a half-built module exists
    when construction refuses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse("PipelineModule")


__all__ = ["LayerSpec", "PipelineModule", "PipelineParallelismNotProvided", "TiedLayerSpec"]
__getattr__ = missing_attributes(__name__)
