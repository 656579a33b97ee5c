"""`deepspeed.ops.op_builder`: DeepSpeed's kernel builders, as zerodp has them: none compiles anything.

DeepSpeed's code and tests ask a builder whether its op can be used here (`Builder().is_compatible()`,
`deepspeed.ops.__compatible_ops__[Builder.NAME]`) and skip what cannot, as they do on an accelerator a
kernel does not support. Here an op is compatible exactly where `deepspeed.ops` provides its optimizer
over torch (`cpu_adam`: DeepSpeedCPUAdam, `fused_adam`: FusedAdam; git_version_info.compatible_ops);
every other builder is not. `load()` / `jit_load()` always raise `OpBuilderNotProvided` naming the op:
zerodp has no compiled modules to hand out (use the optimizer classes in `deepspeed.ops.adam` instead).
"""

from __future__ import annotations

from typing import Any, NoReturn

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.git_version_info import compatible_ops


class OpBuilderNotProvided(NotImplementedError):
    """A DeepSpeed kernel builder was asked for its compiled module; zerodp compiles none."""

    def __init__(self, builder: str, op: str) -> None:
        hint = ("; use deepspeed.ops.adam (DeepSpeedCPUAdam / FusedAdam run torch's fused Adam)"
                if op in ("cpu_adam", "fused_adam") else "")
        super().__init__(f"{builder}().load(): DeepSpeed's compiled op '{op}' is not provided by zerodp, which "
                         f"builds no kernels{hint}")
        self.builder, self.op = builder, op

    def __reduce__(self) -> tuple:
        return type(self), (self.builder, self.op)


class OpBuilder:
    """Base of the builders: `NAME`, `is_compatible()`, `load()` (refused), DeepSpeed's version probes."""

    NAME = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """The op's module path in DeepSpeed (`deepspeed.ops.<name>.<name>_op`)."""
        return f"deepspeed.ops.{self.NAME}.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True where zerodp provides the op's optimizer over torch (see the module docstring)."""
        return bool(compatible_ops.get(self.NAME, False))

    def builder(self) -> NoReturn:
        raise OpBuilderNotProvided(type(self).__name__, self.NAME)

    def load(self, verbose: bool = True) -> NoReturn:
        raise OpBuilderNotProvided(type(self).__name__, self.NAME)

    def jit_load(self, verbose: bool = True) -> NoReturn:
        raise OpBuilderNotProvided(type(self).__name__, self.NAME)

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """(0, 0): no ROCm toolkit is used (DeepSpeed's value when there is none)."""
        return (0, 0)

    @staticmethod
    def installed_cuda_version(name: str = "") -> tuple[int, int]:
        """(0, 0): no CUDA toolkit is used to build anything."""
        return (0, 0)

    @staticmethod
    def is_rocm_pytorch() -> bool:
        import torch

        return torch.version.hip is not None


_BUILDERS: dict[str, str] = {
    "AsyncIOBuilder": "async_io", "CPUAdagradBuilder": "cpu_adagrad", "CPUAdamBuilder": "cpu_adam",
    "CPULionBuilder": "cpu_lion", "DeepCompileBuilder": "dc", "EvoformerAttnBuilder": "evoformer_attn",
    "FPQuantizerBuilder": "fp_quantizer", "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds", "InferenceBuilder": "transformer_inference",
    "InferenceCoreBuilder": "inference_core_ops", "InferenceCutlassBuilder": "cutlass_ops",
    "NotImplementedBuilder": "deepspeed_not_implemented", "PinMemoryBuilder": "pin_memory",
    "QuantizerBuilder": "quantizer", "RaggedOpsBuilder": "ragged_ops", "RaggedUtilsBuilder": "ragged_device_ops",
    "RandomLTDBuilder": "random_ltd", "SparseAttnBuilder": "sparse_attn", "SpatialInferenceBuilder": "spatial_inference",
    "StochasticTransformerBuilder": "stochastic_transformer", "TransformerBuilder": "transformer",
    "UtilsBuilder": "utils",
}
"""DeepSpeed's builder classes -> their op NAME."""

for _class_name, _op in _BUILDERS.items():
    globals()[_class_name] = type(_class_name, (OpBuilder,), {"NAME": _op, "__module__": __name__,
                                                               "__doc__": f"DeepSpeed's `{_op}` builder (see OpBuilder)."})

ALL_OPS: dict[str, Any] = {op: globals()[name]() for name, op in _BUILDERS.items() if op != "deepspeed_not_implemented"}
"""DeepSpeed's `op_builder.all_ops.ALL_OPS`: op NAME -> a builder."""

__all__ = ["ALL_OPS", "OpBuilder", "OpBuilderNotProvided", *sorted(_BUILDERS)]
__getattr__ = missing_attributes(__name__)
