"""`deepspeed.git_version_info`: what this `deepspeed` is and which of DeepSpeed's compiled ops it has.

    from deepspeed.git_version_info import version, torch_info, installed_ops, compatible_ops

`version` is the version the switch reports (`0.20.2+zerodp.<zerodp version>`). zerodp is no git build
of DeepSpeed, so `git_hash` and `git_branch` are DeepSpeed's "[none]" for a tree built outside git.
`torch_info` describes the torch in this process, with DeepSpeed's "0.0" for a toolkit it lacks.
zerodp compiles no kernels: an op is True in `installed_ops` / `compatible_ops` only where
`deepspeed.ops` provides its optimizer over torch (`cpu_adam`: DeepSpeedCPUAdam, `fused_adam`:
FusedAdam); DeepSpeed's test harness reads these to skip what is absent.
"""

from __future__ import annotations

import torch

from _zerodp_as_deepspeed import version as _switch_version
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.accelerator import get_accelerator


def _torch_info() -> dict[str, object]:
    """The torch version (major.minor), bf16 support and CUDA / NCCL / HIP versions ("0.0" when absent)."""
    cuda = torch.version.cuda or "0.0"
    nccl = "0.0"
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version()[:2])
    return {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "bf16_support": get_accelerator().is_bf16_supported(), "cuda_version": ".".join(cuda.split(".")[:2]),
            "nccl_version": nccl, "hip_version": torch.version.hip or "0.0"}


_PROVIDED_OPS = ("cpu_adam", "fused_adam")
"""DeepSpeed's op names whose optimizer deepspeed.ops.adam provides (over torch, nothing compiled)."""
_ABSENT_OPS = ("async_io", "cpu_adagrad", "cpu_lion", "deepspeed_not_implemented", "evoformer_attn", "fp_quantizer",
               "fused_lamb", "fused_lion", "gds", "inference_core_ops", "quantizer", "ragged_device_ops",
               "ragged_ops", "random_ltd", "sparse_attn", "spatial_inference", "transformer", "stochastic_transformer",
               "transformer_inference")

version = _switch_version()
git_hash = "[none]"
git_branch = "[none]"
accelerator_name = get_accelerator().device_name()
torch_info = _torch_info()
installed_ops = {name: name in _PROVIDED_OPS for name in sorted(_PROVIDED_OPS + _ABSENT_OPS)}
compatible_ops = dict(installed_ops)

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
__getattr__ = missing_attributes(__name__)
