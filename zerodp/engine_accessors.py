"""DeepSpeed's engine accessors and the engine's read-only reports, as a mixin of the Engine.

DeepSpeed scripts call these (`engine.train_batch_size()`, `engine.fp16_enabled()`, `engine.get_lr()`,
`engine.step_report()`...): they read the config, the optimizer, the loss scaler and the step reporter,
and change nothing. They live beside the engine so engine.py holds the loop alone (design.md §2).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerodp import comm


class EngineAccessors:
    """Read-only views of an Engine (`config`, `optimizer`, `lr_scheduler`, `loss_scaler`, `strategy`,
    `module`, `reporter`, `_global_grad_norm`, `_step_applied` are the engine's)."""

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        return comm.get_world_size()

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        """True when a ZeRO stage above 0 is on."""
        return self.config.zero_optimization.stage > 0

    @property
    def dp_world_size(self) -> int:
        """Data-parallel world size: all ranks / sequence_parallel_size (zerodp has no model parallelism)."""
        return comm.get_world_size() // self.config.sequence_parallel_size

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks ZeRO partitions over and reduces gradients across (DeepSpeed's name): every rank."""
        return comm.get_world_size()

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing one sequence (Ulysses); 1 without sequence parallelism."""
        return self.config.sequence_parallel_size

    mp_world_size = 1  # no model parallelism

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def optimizer_name(self) -> str:
        return type(self.optimizer).__name__

    def scheduler_name(self) -> str | None:
        return type(self.lr_scheduler).__name__ if self.lr_scheduler is not None else None

    def get_mom(self) -> list:
        """Momentum of each param group: Adam's betas, or SGD's momentum."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's state dict (full parameters at stages 0-2)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def get_lr(self) -> list[float]:
        """Current learning rate of each optimizer param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled, before clipping) of the last applied step."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (inf/nan gradients)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's accessor)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    # --- reports ------------------------------------------------------------------------------

    @property
    def last_metrics(self) -> dict[str, Any]:
        """The last optimizer step's metrics: step, loss, grad_norm, lr, loss_scale, step_time_s,
        samples_per_s ({} before the first step)."""
        return self.reporter.last_metrics

    def step_report(self) -> dict | None:
        """Where the last optimizer step's seconds went, on this rank (None before the first step):
        `seconds` (the step, from the end of the previous one), `forward` and `backward` (their
        compute: the phase minus what it waited on), `communication_exposed` (waiting on
        collectives) and `communication_overlapped` (collectives in flight while the host computed:
        an upper bound), `optimizer` (the boundary step's own work, on the device or, offloaded, on
        the host: `optimizer_on`), `offload_transfers` (host-device copies), `nvme_wait` (waiting on
        the disk), `input` (outside the engine's calls: the data loader and the user's code), and
        `verdict`: "compute-bound", "communication-bound", "offload-bound" or "input-bound", the
        largest of `parts_seconds` (compute: forward + backward + a device optimizer; offload: its
        transfers, disk waits and a host optimizer), with its `share` of the step and the
        `overlap_ratio` (overlapped / all communication). `clock`: "host" (the host's clock) or, on
        CUDA, "cuda-events" (events on the stream that runs the work: the device's time):
        zerodp/timers.py's [Note: the step breakdown]. With `flops_profiler.enabled`, from the profiled step on, `flops`
        (the profiled micro-batch's forward + backward FLOPs x the accumulation steps), `flops_per_s`
        (per `seconds`) and, in bf16 / fp16 on a GPU zerodp.gpus.GPUS names, `mfu` (the model
        FLOPs utilisation: flops_per_s / the device's dense 16-bit peak); None otherwise. With offload,
        `offload`: the step's copies, disk bytes and CPU step against bandwidths probed at start-up,
        and `advice` (zerodp/offload/diagnosis.py's [Note: the offload diagnosis])."""
        report = self.reporter.last_step_report
        return dict(report) if report is not None else None

    @property
    def flops_profile(self) -> dict | None:
        """The flops profiler's result (`flops_profiler.enabled`; None until its micro-batch ran):
        FLOPs and seconds of the forward and the backward, and per module (`modules`) its parameters,
        forward FLOPs and forward latency. zerodp/profiler.py's [Note: the flops profile]."""
        return self.reporter.flops_profiler.profile

    def swap_report(self) -> dict:
        """NVMe offload, per swap store ("optimizer", "parameters"): bytes read and written since
        start-up, the seconds with reads / writes in flight, and the MB/s achieved while in flight.
        Compare with the disk's own bandwidth (docs/offload.md); {} without NVMe offload."""
        report = {}
        for name, store in self.strategy.swap_stores().items():
            stats = store.counters
            report[name] = {"read_bytes": stats.read_bytes, "written_bytes": stats.written_bytes,
                            "read_seconds": stats.read_seconds, "write_seconds": stats.write_seconds,
                            "read_MBps": stats.read_MBps, "write_MBps": stats.write_MBps}
        return report
