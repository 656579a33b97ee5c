"""The GPUs zerodp knows by name, with their vendors' figures: pure data, read by the planner's presets
(zerodp/plan/cluster.py) and by the step report's model FLOPs utilisation (zerodp/profiler.py).

It sits at the floor so the runtime can read a peak without importing the planner above it.
"""

from __future__ import annotations

from typing import NamedTuple


class GpuSpec(NamedTuple):
    """One GPU's vendor figures: bytes of memory, dense bf16 FLOP/s, memory bandwidth (bytes/s), the
    NVLink ring bandwidth per GPU (bytes/s) and the host link (bytes/s)."""

    memory_bytes: int
    peak_flops: float
    memory_bandwidth: float
    ring_bandwidth: float
    host_link: float


GPUS = {
    "a100-40gb": GpuSpec(40 * 10**9, 312e12, 1.555e12, 230e9, 25e9),
    "a100-80gb": GpuSpec(80 * 10**9, 312e12, 2.039e12, 230e9, 25e9),
    "h100": GpuSpec(80 * 10**9, 989e12, 3.35e12, 360e9, 50e9),
    "h200": GpuSpec(141 * 10**9, 989e12, 4.8e12, 360e9, 50e9),
}
"""Vendor figures; the ring bandwidths are NCCL bus bandwidths reported for 8-GPU NVSwitch nodes."""


def peak_flops_of(device_name: str) -> float | None:
    """The dense 16-bit peak FLOP/s of the GPU whose name (torch.cuda.get_device_name, e.g. "NVIDIA H100
    80GB HBM3", "NVIDIA A100-SXM4-40GB") contains a GPUS family; None for a GPU the table does not know."""
    name = device_name.lower()
    return next((spec.peak_flops for gpu, spec in GPUS.items() if gpu.split("-")[0] in name), None)
