"""Where a strategy keeps the optimizer's tensors and the parameter shards: on the device, or in
host memory (ZeRO-Offload: `offload_optimizer.device: cpu`, `offload_param.device: cpu`).

[Note: CPU offload]
With `offload_optimizer.device: cpu` the fp32 master of the owned shard, the optimizer state and
the reduced gradient shard live in host memory (pinned when CUDA is present and `pin_memory` is
on). Each reduced gradient piece is copied down as it is produced (stages 2 and 3; stage 1 reduces
once, at the boundary) and accumulated there; the optimizer steps on the CPU (torch's fused AdamW,
which bench/cpu_adam.py measures against DeepSpeed's CPUAdam); the updated shard is copied back to
the device in working precision. With `offload_param.device: cpu` (stage 3) the parameter shards
live on the host too and are copied to the device just before their all-gather. The device then
holds only the units being computed and the buffers in flight. Nothing changes numerically: the
same fp32 operations run on the same values, so offloaded training is bitwise equal to
non-offloaded training in fp32 (tests/test_offload.py).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from zerodp.memory import CPU, DEVICE, nbytes
from zerodp.offload.nvme import OPTIMIZER_NVME_PATH_KEY, PARAM_NVME_PATH_KEY, check_host_memory, check_nvme_path
from zerodp.offload.swap import swap_chunk_numel
from zerodp.timers import waiting


class Home:
    """One place tensors live: the device, or host memory standing in for it."""

    def __init__(self, device: torch.device, offload: bool, pin_memory: bool) -> None:
        self.compute_device = device  # where the model trains
        self.offload = offload
        self.device = torch.device("cpu") if offload else device
        self.pin = offload and pin_memory and torch.cuda.is_available()
        self.tier = CPU if offload else DEVICE

    @classmethod
    def for_section(cls, device: torch.device, section) -> Home:
        """From a config `offload_optimizer` / `offload_param` section (None or device none: no offload)."""
        offload = section is not None and section.device in ("cpu", "nvme")  # nvme: swapped from host memory
        pin = section is not None and section.device == "cpu" and section.pin_memory  # swapped storage is resized
        return cls(device, offload, bool(pin))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    def master_of(self, shard: torch.Tensor, dtype: torch.dtype = torch.float32, copy: bool = False) -> torch.Tensor:
        """The master (in `dtype`: fp32, or bf16 with bf16 master weights) of a working-precision
        shard: the shard itself when it has that dtype and is not offloaded (and not `copy`: a shard
        that will be swapped out to NVMe cannot be what the optimizer steps), else a copy here."""
        if shard.dtype == dtype and not self.offload and not copy:
            return shard
        master = self.empty(shard.numel(), dtype)
        master.copy_(shard)
        return master

    @staticmethod
    def accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst += src, copying `src` to dst's device first (a reduced piece going down to the host)."""
        if src.device == dst.device:
            dst.add_(src)
            return
        with waiting("offload", nbytes(src)):
            dst.add_(src.to(dst.device))

    def converted(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` in `dtype` here: itself when it already is, else a converted copy (a transient)."""
        if tensor.dtype == dtype and tensor.device == self.device:
            return tensor
        if tensor.device == self.device:
            return tensor.to(dtype=dtype)
        with waiting("offload", tensor.numel() * dtype.itemsize):
            return tensor.to(device=self.device, dtype=dtype)

    @staticmethod
    def publish(dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy an updated master `src` into working shard `dst` (casting), unless it is `dst`."""
        if src is dst:
            return
        with waiting("offload", nbytes(dst)) if src.device != dst.device else nullcontext():
            dst.copy_(src, non_blocking=src.device.type == "cpu" and src.is_pinned())


def preflight_offload(config, trainable_numel: int) -> None:
    """Before any rank communicates, for every rank of this machine: the NVMe folders exist, are
    writable and have room for the parameter shards (at most 4 bytes per owned element) and the
    fp32 masters + Adam state (12); host memory can hold what CPU offload puts there (master, Adam
    state and gradient shard, 16), and, for NVMe at stages 1-2, the `buffer_count` swap chunks of
    `sub_group_size` elements in memory at once (12 bytes each). ValueError with the numbers otherwise."""
    zero = config.zero_optimization
    owned = -(-trainable_numel // config.batch.world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of this machine share its disk and memory
    params = zero.offload_param
    if params is not None and params.device == "nvme":  # working-precision shards (at most 4 bytes)
        check_nvme_path(params.nvme_path, 4 * owned * local, key=PARAM_NVME_PATH_KEY)
    section = zero.offload_optimizer
    if section is None or section.device == "none":
        return
    if section.device == "nvme":
        check_nvme_path(section.nvme_path, 12 * owned * local, key=OPTIMIZER_NVME_PATH_KEY)
        if zero.stage in (1, 2):  # the swap chunks in memory at once (stage 3's are its units)
            chunk = min(swap_chunk_numel(int(zero.sub_group_size)), owned)
            resident = min(max(1, int(section.buffer_count)), -(-owned // chunk))
            check_host_memory(12 * chunk * resident * local,
                              what=f"offload_optimizer (device nvme): {resident} swap chunks (buffer_count) of "
                                   f"{chunk:,} elements (zero_optimization.sub_group_size) for {local} rank(s)",
                              fix="lower zero_optimization.sub_group_size (e.g. 1e8) or offload_optimizer.buffer_count")
    else:
        check_host_memory(16 * owned * local, what=f"offload_optimizer (device cpu) for {local} rank(s) on this machine",
                          fix="offload to NVMe (device nvme, stage 3), use more machines, or train in fewer bytes")
