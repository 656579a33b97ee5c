"""The step reporter: what the engine says about each optimizer step, beside the engine, not in it.

It owns the step clock (`engine.step_report()`: zerodp/timers.py's [Note: the step breakdown]), the
flops profiler (zerodp/profiler.py's [Note: the flops profile]), the offload diagnosis's start-up
probes and swap counters (zerodp/offload/diagnosis.py's [Note: the offload diagnosis]) and the
per-step metrics (`engine.last_metrics`, the `steps_per_print` line). The engine times its phases on
`reporter.clock`, hands each micro-batch's loss to `note_loss`, and calls `record` after a boundary step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zerodp import checkpointing
from zerodp.log import log_rank0
from zerodp.offload.diagnosis import OffloadProbes, diagnose, probe_offload
from zerodp.profiler import FlopsProfiler, device_peak_flops
from zerodp.timers import StepClock, Timers
from zerodp.zero.base import Strategy


def on_host(section: Any) -> bool:
    """Whether an offload section (offload_optimizer / offload_param) puts its tensors on the host
    (device cpu, or nvme: swapped through host memory)."""
    return section is not None and section.device in ("cpu", "nvme")


class StepReporter:
    """Step breakdown, flops profile, offload diagnosis and metrics of one engine's steps."""

    def __init__(self, module: nn.Module, config: Any, strategy: Strategy, timers: Timers) -> None:
        self.config = config
        self.strategy = strategy
        self.timers = timers  # wall_clock_breakdown's phases, printed with the step line
        self.clock = StepClock(strategy.device)  # engine.step_report(): [Note: the step breakdown]
        self.last_step_report: dict[str, Any] | None = None
        self.last_metrics: dict[str, Any] = {}
        zero = config.zero_optimization
        self.optimizer_on_host = on_host(zero.offload_optimizer)
        optimizer = strategy.optimizer
        # [Note: the offload diagnosis]: fixed after start-up, so taken once
        swapper = strategy.swapper
        self._swap_layout = swapper.layout() if swapper is not None else None
        self._host_elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"]) \
            if self.optimizer_on_host and optimizer is not None else 0
        self.offload_probes = self._probe_offload() if on_host(zero.offload_param) or self.optimizer_on_host else None
        self._swap_marks = self._swap_counters()
        self.flops_profiler = FlopsProfiler(module, config.flops_profiler, strategy.device)  # [Note: the flops profile]
        self._peak_flops = device_peak_flops(strategy.device, strategy.policy.param_dtype)  # for the MFU
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses, for the metrics
        self._num_losses = 0

    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (engine.backward), for the step's mean loss."""
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._num_losses += 1

    def record(self, step: int, scale: float, grad_norm: float | None, lr: float,
               memory_report: Callable[[], dict]) -> None:
        """After boundary step `step`: the step report, the metrics, and the steps_per_print lines.
        `grad_norm`: None when the step was skipped; `memory_report`: for memory_breakdown."""
        report = self.clock.take(self.optimizer_on_host)
        wall = report["seconds"]
        self.last_step_report = {"step": step, **report, **self._step_flops(wall)}
        if self.offload_probes is not None:
            self.last_step_report["offload"] = self._offload_report(self.last_step_report)
        self.last_metrics = {
            "step": step,
            "loss": float(self._loss_sum) / self._num_losses if self._num_losses else None,
            "grad_norm": grad_norm,
            "lr": lr,
            "loss_scale": scale if self.config.fp16.enabled else None,
            "step_time_s": wall,
            "samples_per_s": self.config.train_batch_size / max(wall, 1e-9),
        }
        self._loss_sum, self._num_losses = None, 0
        # Asking for a breakdown without steps_per_print gets it every step rather than never.
        every = self.config.steps_per_print or (
            1 if self.config.wall_clock_breakdown or self.config.memory_breakdown else None)
        if every and step % every == 0:
            self._print_step(memory_report)

    def _print_step(self, memory_report: Callable[[], dict]) -> None:
        """The lines steps_per_print asks for, on rank 0: the step's metrics, then with
        wall_clock_breakdown the time per phase, with memory_breakdown the memory ledger."""
        from zerodp.metrics import format_breakdown, format_memory, format_step, format_times

        log_rank0(format_step(self.last_metrics))
        if self.config.wall_clock_breakdown:
            times = self.timers.take()
            if checkpointing.options.profile:
                times["recompute"] = checkpointing.profile.take()["recompute_s"]
            log_rank0(format_times(times))
            log_rank0(format_breakdown(self.last_step_report))
        if self.config.memory_breakdown:
            log_rank0(format_memory(memory_report()))

    def _step_flops(self, wall: float) -> dict[str, float | None]:
        """The step's FLOPs from the flops profile (None before it ran, or without its backward)."""
        profile = self.flops_profiler.profile
        if profile is None or profile["backward_flops"] is None or wall <= 0:
            return {"flops": None, "flops_per_s": None, "mfu": None}
        flops = profile["flops"] * self.config.gradient_accumulation_steps
        return {"flops": flops, "flops_per_s": flops / wall,
                "mfu": flops / wall / self._peak_flops if self._peak_flops else None}

    def _probe_offload(self) -> OffloadProbes | None:
        """The offload diagnosis's start-up probes; None without an optimizer (an engine that never
        steps has no step report)."""
        optimizer = self.strategy.optimizer
        if optimizer is None:
            return None
        stores = self.strategy.swap_stores()
        swap_bytes = {name: store.allocated_bytes for name, store in stores.items()}
        if self._swap_layout is not None:  # the state appears at the first step: fp32 master and Adam's two moments
            swap_bytes["optimizer"] = 12 * self._swap_layout["elements"]
        return probe_offload(self.strategy.device, optimizer, self.optimizer_on_host, stores, swap_bytes,
                             self.config.aio)

    def _swap_counters(self) -> dict:
        return {name: store.counters for name, store in self.strategy.swap_stores().items()}

    def _offload_report(self, report: dict) -> dict:
        """report["offload"] for the step just taken: [Note: the offload diagnosis]."""
        now = self._swap_counters()
        traffic = {name: (stats.read_bytes - self._swap_marks[name].read_bytes,
                          stats.written_bytes - self._swap_marks[name].written_bytes) for name, stats in now.items()}
        self._swap_marks = now
        return diagnose(report, self.offload_probes, traffic, self._swap_layout, self._host_elements, self.config)
