"""The Engine: forward / backward / step with accumulation, loss scaling, clipping and the schedule.

Where tensors live and how they move is the strategy's business (zero/); the engine owns the
training loop's bookkeeping and never branches on the ZeRO stage.

    engine, optimizer, loader, scheduler = zerodp.initialize(model=model, config="ds.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)   # loss / accumulation steps * loss scale; reduces at the boundary
        engine.step()           # every micro-batch; optimizer + scheduler only at the boundary
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerodp import checkpointing, comm
from zerodp.config import ZeroDPConfig
from zerodp.data import ResumableDistributedSampler
from zerodp.log import log_rank0, logger
from zerodp.memory import DEVICE, Category
from zerodp.offload.park import ParkedStorages
from zerodp.optim import NoOptimizer
from zerodp.precision import make_loss_scaler, overflow_message
from zerodp.profiler import FlopsProfiler, device_peak_flops
from zerodp.offload.diagnosis import OffloadProbes, diagnose, probe_offload
from zerodp.timers import StepClock, ThroughputTimer, Timers
from zerodp.zero.base import Strategy


_engine_backwards_running = 0
"""engine.backward calls in progress in this process, any engine's: their loss is already divided by
the accumulation steps, so no engine's forward hook divides it again (a GAN generator's loss runs
through the discriminator engine's output)."""


class PhaseWatcher(Protocol):
    """What watches the engine's phases ("forward", "backward", "step"): the OOM doctor."""

    def watching(self, phase: str) -> AbstractContextManager[None]: ...


class _Unwatched:
    """No watcher: each phase runs as it is."""

    def watching(self, phase: str) -> AbstractContextManager[None]:
        return nullcontext()


UNWATCHED = _Unwatched()


class Engine(nn.Module):
    """DeepSpeed's engine API over a zerodp Strategy. Build it with `zerodp.initialize`."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroDPConfig,
        strategy: Strategy,
        lr_scheduler: Any = None,
        training_data: Dataset | None = None,
        collate_fn: Any = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.strategy = strategy
        self.comm_ledger = strategy.comm_ledger  # its collectives alone: [Note: one comm ledger per engine]
        self.optimizer = strategy.optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = make_loss_scaler(config.fp16)
        self._parked = ParkedStorages()  # engine.offload_states()
        self.check_overflow = config.fp16.enabled or (config.bf16.enabled and config.bf16.check_grad_overflow)
        self.timers = Timers(synchronize=config.wall_clock_breakdown and strategy.device.type == "cuda")
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self.clock = StepClock(strategy.device)  # engine.step_report(): [Note: the step breakdown]
        self.last_step_report: dict[str, Any] | None = None
        zero = config.zero_optimization
        self._optimizer_on_host = _on_host(zero.offload_optimizer)
        # [Note: the offload diagnosis]: fixed after start-up, so taken once
        swapper = getattr(strategy, "swapper", None)
        self._swap_layout = swapper.layout() if swapper is not None else None
        self._host_elements = sum(p.numel() for group in self.optimizer.param_groups for p in group["params"]) \
            if self._optimizer_on_host and self.optimizer is not None else 0
        self.offload_probes = self._probe_offload() if _on_host(zero.offload_param) or self._optimizer_on_host else None
        self._swap_marks = self._swap_counters()
        self.flops_profiler = FlopsProfiler(module, config.flops_profiler, strategy.device)  # [Note: the flops profile]
        self._peak_flops = device_peak_flops(strategy.device, strategy.policy.param_dtype)  # for the MFU
        self.micro_steps = 0
        self._forwards = 0  # forward calls: a forward-only engine's flops profiler counts them
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._global_grad_norm: float | None = None
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._in_step = False  # managed_gradient_accumulation=false: the boundary is step() itself
        self._loss_sum: torch.Tensor | None = None  # this step's micro-batch losses, for the metrics
        self._num_losses = 0
        self._param_storages = checkpointing.storage_keys(strategy.parameter_storages())  # not activations
        # count what autograd saves in each forward (memory_report()["activations"]); off for engines built
        # through `deepspeed.initialize` unless memory_breakdown asks ([Note: counting saved activations])
        self.count_activations = True
        self._saved_peak: dict[str, int] = {}  # saved-activation bytes, this step's largest micro-batch
        self.saved_activations_peak: dict[str, int] = {}  # ... of the last completed step
        self.last_metrics: dict[str, Any] = {}
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
        self._manual_scales = 0  # engine.scale(loss) calls since the last step, for loss.backward()
        strategy.implicit_backward_boundary = lambda: self.is_gradient_accumulation_boundary() and not self._no_sync
        self.doctor: PhaseWatcher = UNWATCHED  # api.initialize installs the OOM doctor (watch_phases)
        _clear_strategy_grads_on_module_zero_grad(module, self)

    def watch_phases(self, watcher: "PhaseWatcher") -> None:
        """Run forward, backward and the optimizer step inside `watcher.watching(phase)` from now on
        (api.initialize installs zerodp/plan/doctor.py's OOM doctor here; the engine never imports it)."""
        self.doctor = watcher

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine does not have is looked up on the wrapped module, as DeepSpeed's
        engine does (`engine.generate(...)`, `engine.gradient_checkpointing_enable()`); the engine's own
        names win (`engine.config` is the training config, not the model's)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name == "module":
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                                     f"attribute '{name}'") from None

    # --- DeepSpeed's accessors ----------------------------------------------------------------

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
        """Data-parallel world size (all ranks: zerodp has no model parallelism)."""
        return comm.get_world_size()

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

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-batch whose backward completes an optimizer step."""
        if self._boundary_override is not None:
            return self._boundary_override
        if not self.config.managed_gradient_accumulation:
            return self._in_step
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force the boundary on or off (None: back to counting micro-batches)."""
        self._boundary_override = is_boundary

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates without communicating; step() inside is an error. Not
        available at stage 2, which reduces (and frees) gradients in every backward."""
        if self.strategy.reduces_every_micro_batch:
            raise RuntimeError(f"no_sync() is not possible at ZeRO stage {self.zero_optimization_stage()}: "
                               "it reduces gradients in every backward; use stage 0 or 1")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # --- the loop -----------------------------------------------------------------------------

    @comm.records_to_own_ledger
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (inputs cast to fp16 when `fp16.auto_cast`)."""
        self._check_resident("forward")
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        # a forward-only engine has no steps to report (and its clock would keep every forward's marks)
        timed = self.clock.phase("forward") if not self.forward_only else nullcontext()
        with timed, self.timers("fwd"), self._explained_errors(), self.doctor.watching("forward"), \
                checkpointing.count_saved_activations(self._param_storages, self.count_activations) as saved, \
                self.flops_profiler.forward(self._forwards if self.forward_only else self.global_steps,
                                            backward=not self.forward_only):
            out = self.module(*args, **kwargs)
        self._forwards += 1
        if saved.total > sum(self._saved_peak.values()):
            self._saved_peak = dict(saved.bytes_by_tier)
        if self.config.gradient_accumulation_steps > 1 and torch.is_grad_enabled():
            self._divide_direct_backward_by_accumulation(out)
        return out

    def _divide_direct_backward_by_accumulation(self, out: Any) -> None:
        """Make `loss.backward()` on this forward's output divide by the accumulation steps, as
        engine.backward does (DeepSpeed's behaviour): a hook on the scalar outputs (the losses), or on
        every output when there is none (a loss computed outside the model). Not on both: a loss
        computed from the logits inside the model would be divided twice."""
        tensors = [t for t in _tensors_in(out) if t.requires_grad]
        scalars = [t for t in tensors if t.numel() == 1]
        gas = self.config.gradient_accumulation_steps
        for t in scalars or tensors:
            t.register_hook(lambda grad: grad if _engine_backwards_running else grad / gas)

    @comm.records_to_own_ledger
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` / gradient_accumulation_steps x loss scale; returns the loss divided by
        the accumulation steps (DeepSpeed's return value). Reduces gradients at the boundary."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {_describe(loss)}")
        self._check_resident("backward")
        self._check_trains("backward")
        boundary = self.is_gradient_accumulation_boundary() and not self._no_sync
        gas = self.config.gradient_accumulation_steps
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._num_losses += 1
        with self.clock.phase("backward"), self.timers("bwd"), self._explained_errors(), \
                self.doctor.watching("backward"):
            self.strategy.begin_backward(boundary)
            to_backward = scaled * self.loss_scaler.loss_scale if self.loss_scaler.loss_scale != 1.0 else scaled
            global _engine_backwards_running
            _engine_backwards_running += 1
            try:
                with self.flops_profiler.backward():
                    to_backward.backward(retain_graph=retain_graph)
            except BaseException:
                self.strategy.backward_open = False
                raise
            finally:
                _engine_backwards_running -= 1
            self.strategy.end_backward(boundary)
        return scaled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current loss scale, for a `loss.backward()` of your own on an fp16 engine
        (DeepSpeed's `engine.scale(loss).backward()`); bf16 and fp32 engines return `loss` itself."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(f"engine.scale expects a scalar loss tensor with a graph, got {_describe(loss)}")
        self._manual_scales += 1
        scale = self.loss_scaler.loss_scale
        return loss * scale if scale != 1.0 else loss

    @contextmanager
    def _explained_errors(self) -> Iterator[None]:
        """Add the strategy's hint to an error raised in the model's forward or backward."""
        try:
            yield
        except RuntimeError as err:
            hint = self.strategy.error_hint(err)
            if hint and hasattr(err, "add_note"):  # Python >= 3.11
                err.add_note(hint)
            raise

    @comm.records_to_own_ledger
    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every backward: at the accumulation boundary unscale, clip, run the optimizer and
        the scheduler, zero gradients; elsewhere only count the micro-batch."""
        if self._no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave no_sync before the boundary step")
        self._check_resident("step")
        self._check_trains("step")
        self._in_step = True
        try:
            if self.is_gradient_accumulation_boundary():
                self.flops_profiler.finish()  # a profiled forward whose backward was not engine.backward
                with self.clock.phase("step"), self.timers("step"), self.doctor.watching("step"):
                    scale = self._take_model_step(lr_kwargs)
                self.tput_timer.step_finished()
                self._record_metrics(scale)
        finally:
            self._in_step = False
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None) -> float:
        """The boundary's work; returns the loss scale the step ran with."""
        if self.config.fp16.enabled and self.strategy.implicit_backwards > self._manual_scales:
            raise RuntimeError(
                "loss.backward() was called on an fp16 engine without the loss scale: fp16 gradients need it to "
                "stay finite, and the step divides them by it. Call engine.backward(loss), or "
                "engine.scale(loss).backward(). (bf16 and fp32 engines accept a plain loss.backward().)")
        self.strategy.finish_reduction()
        overflow = self.check_overflow and self.strategy.found_overflow()
        scale = self.loss_scaler.loss_scale
        if overflow:
            name = self.strategy.first_overflow_name()
            self.loss_scaler.update(True)  # raises LossScaleAtMinimumError at the minimum
            self.skipped_steps += 1
            log_rank0(overflow_message(self.global_steps + 1, scale, self.loss_scaler, name), level=logging.WARNING)
        else:
            self._global_grad_norm = self.strategy.step(scale, self.config.gradient_clipping)
            self.loss_scaler.update(False)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self._step_applied = not overflow
        self.zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        comm.end_step(self.comm_ledger)
        return scale

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
        if self.optimizer is None:
            return None
        stores = self.strategy.swap_stores()
        swap_bytes = {name: store.allocated_bytes for name, store in stores.items()}
        if self._swap_layout is not None:  # the state appears at the first step: fp32 master and Adam's two moments
            swap_bytes["optimizer"] = 12 * self._swap_layout["elements"]
        return probe_offload(self.device, self.optimizer, self._optimizer_on_host, stores, swap_bytes, self.config.aio)

    def _swap_counters(self) -> dict:
        return {name: store.counters for name, store in self.strategy.swap_stores().items()}

    def _offload_report(self, report: dict) -> dict:
        """report["offload"] for the step just taken: [Note: the offload diagnosis]."""
        now = self._swap_counters()
        traffic = {name: (stats.read_bytes - self._swap_marks[name].read_bytes,
                          stats.written_bytes - self._swap_marks[name].written_bytes) for name, stats in now.items()}
        self._swap_marks = now
        return diagnose(report, self.offload_probes, traffic, self._swap_layout, self._host_elements, self.config)

    def _record_metrics(self, scale: float) -> None:
        report = self.clock.take(self._optimizer_on_host)
        wall = report["seconds"]
        self.last_step_report = {"step": self.global_steps, **report, **self._step_flops(wall)}
        if self.offload_probes is not None:
            self.last_step_report["offload"] = self._offload_report(self.last_step_report)
        self.last_metrics = {
            "step": self.global_steps,
            "loss": float(self._loss_sum) / self._num_losses if self._num_losses else None,
            "grad_norm": self._global_grad_norm if self._step_applied else None,
            "lr": self.get_lr()[0],
            "loss_scale": scale if self.config.fp16.enabled else None,
            "step_time_s": wall,
            "samples_per_s": self.config.train_batch_size / max(wall, 1e-9),
        }
        self._loss_sum, self._num_losses = None, 0
        self.saved_activations_peak, self._saved_peak = self._saved_peak, {}
        # Asking for a breakdown without steps_per_print gets it every step rather than never.
        every = self.config.steps_per_print or (
            1 if self.config.wall_clock_breakdown or self.config.memory_breakdown else None)
        if every and self.global_steps % every == 0:
            self._print_step()

    def _print_step(self) -> None:
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
            log_rank0(format_memory(self.memory_report()))

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the boundary step already does this; `engine.module.zero_grad()`
        does it too)."""
        self.strategy.zero_grad()
        self.strategy.implicit_backwards = self._manual_scales = 0

    # --- data and reports ---------------------------------------------------------------------

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> DataLoader:
        """A DataLoader giving this rank its share of `dataset` (DeepSpeed's signature): a shuffled
        sampler that checkpoints record the position of (zerodp.data), unless `data_sampler` is
        given; `batch_size` = the micro batch. Call `loader.sampler.set_epoch(epoch)` each epoch
        for a new order."""
        sampler = data_sampler or ResumableDistributedSampler(
            dataset, num_replicas=comm.get_world_size(), rank=comm.get_rank(),
            shuffle=route == "train", drop_last=self.config.dataloader_drop_last,
        )
        return DataLoader(
            dataset, batch_size=batch_size or self.config.train_micro_batch_size_per_gpu, sampler=sampler,
            collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda", drop_last=self.config.dataloader_drop_last,
        )

    @comm.records_to_own_ledger
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save a sharded, crash-safe checkpoint into `save_dir/tag` (default tag
        `global_step{N}`); call it on every rank. See docs/checkpoints.md."""
        from zerodp.checkpoint import save_checkpoint

        self._check_resident("save_checkpoint")
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    @comm.records_to_own_ledger
    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size and ZeRO stage; returns (path, client_state)
        or (None, None) when `load_dir/latest` does not exist. Call it on every rank."""
        from zerodp.checkpoint import load_checkpoint

        self._check_resident("load_checkpoint")
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    # --- freeing the device between phases (RLHF) ---------------------------------------------

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move this rank's training state off the device into host memory until `reload_states()`
        (DeepSpeed's method: RLHF loops free the device for generation between training phases).
        `include`: which of "optim_states" (optimizer state), "hp_params" (fp32 masters; in fp32
        training the parameters themselves), "lp_params" (16-bit parameters), "lp_grads" and
        "contiguous_grad_buffer" (gradient buffers); default all (DeepSpeed's `OffloadStateTypeEnum`
        values work too). State already offloaded by the config stays where it is. `device`: "cpu"
        ("none" does nothing). `pin_memory`: page-locked host buffers (CUDA). Until reloaded, forward,
        backward, step and checkpoints raise. See zerodp/offload/park.py."""
        kinds = _offload_kinds(include)
        device = getattr(device, "value", device)
        if device == "none":
            logger.warning("offload_states(device='none'): nothing to do")
            return
        if device != "cpu":
            raise ValueError(f"offload_states(device={device!r}): only 'cpu' is supported (as in DeepSpeed; "
                             "NVMe offload of model states is the config's offload_optimizer / offload_param)")
        categories = {category for kind in kinds for category in _OFFLOAD_KINDS[kind]}
        ledger = self.strategy.ledger()
        tensors = [t for (category, tier), held in ledger.tensors.items() if category in categories and tier == DEVICE
                   for t in held]
        moved = self._parked.park(tensors, pin_memory=pin_memory, non_blocking=non_blocking)
        logger.info("offload_states: %d bytes of %s moved to host memory", moved, ", ".join(sorted(kinds)))

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states` moved, every tensor at its old place (no-op when nothing is)."""
        moved = self._parked.restore(non_blocking=non_blocking)
        logger.info("reload_states: %d bytes moved back", moved)

    @contextmanager
    def generation(self, max_live_parameters: int | None = None) -> Iterator[None]:
        """Generate fast at ZeRO stage 3: inside the block, each unit that a forward without grad gathers
        stays gathered for the block's later forwards, while the units kept total at most
        `max_live_parameters` elements (default: the config's stage3_max_live_parameters); the rest
        gather per forward as usual. At exit every kept unit is released. A no-op at stages 0-2, whose
        parameters are whole anyway. `engine.step()` inside is an error, as inside GatheredParameters.

            with torch.no_grad(), engine.generation():
                out = engine.module.generate(prompt, max_new_tokens=64)
        """
        if not hasattr(self.strategy, "generation"):
            yield
            return
        budget = self.config.zero_optimization.stage3_max_live_parameters if max_live_parameters is None \
            else max_live_parameters
        if budget < 0:
            raise ValueError(f"engine.generation(max_live_parameters={budget}): expected a count of elements >= 0")
        with self.strategy.generation(int(budget)):
            yield

    @property
    def forward_only(self) -> bool:
        """Whether this engine was built without an optimizer (see zerodp.initialize): forward only."""
        return isinstance(self.optimizer, NoOptimizer)

    def _check_trains(self, what: str) -> None:
        if self.forward_only:
            raise RuntimeError(f"engine.{what}() on an engine that runs forward only ({self.optimizer.reason}); "
                               "to train, pass optimizer= to initialize() or add an \"optimizer\" section to the "
                               "config, and leave some parameters trainable")

    def _check_resident(self, what: str) -> None:
        if len(self._parked):
            raise RuntimeError(f"engine.{what}() while the engine's states are offloaded (engine.offload_states()): "
                               "call engine.reload_states() first")

    def _frozen_names(self) -> set[str]:
        """State-dict names of the module's frozen parameters (tied aliases included)."""
        return {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's accessor)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    @comm.records_to_own_ledger
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full 16-bit state dict of a stage-3 model on rank 0's host, gathered one unit at a time;
        None on the other ranks (DeepSpeed's method, which accelerate's `get_state_dict` calls). Call
        it on every rank. ValueError below stage 3."""
        if self.zero_optimization_stage() != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict() needs ZeRO stage 3 "
                             f"(this engine runs stage {self.zero_optimization_stage()}); use module.state_dict()")
        frozen = self._frozen_names()
        state = self.strategy.gathered_state_dict(keep=(lambda n: n not in frozen) if exclude_frozen_parameters else None)
        return state if comm.get_rank() == 0 else None

    @comm.records_to_own_ledger
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full working-precision weights to `save_dir/save_filename` from rank 0 (a
        `.safetensors` name writes safetensors, tied aliases once), and beside it a transformers model's
        config.json and generation_config.json; call it on every rank. At stage 3
        it needs `stage3_gather_16bit_weights_on_model_save` (parameters are gathered one unit at a
        time into rank 0's host memory). Returns True."""
        from pathlib import Path

        from zerodp.checkpoint.convert import save_hf_config, write_safetensors
        from zerodp.checkpoint.save import tied_names

        self.strategy.check_full_weights_allowed()  # stage 3: explains the missing config key
        state = self.module.state_dict()  # stage 3: gathers one unit at a time
        if exclude_frozen_parameters:
            frozen = self._frozen_names()
            state = {n: t for n, t in state.items() if n not in frozen}
        if comm.get_rank() == 0:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            if path.suffix == ".safetensors":
                aliases = tied_names(self.module)
                write_safetensors(tmp, [(n, t.contiguous()) for n, t in state.items() if n not in aliases])
            else:
                torch.save(state, tmp)
            tmp.replace(path)
            save_hf_config(self.module, save_dir)  # a transformers model: from_pretrained(save_dir) works
            log_rank0("saved 16-bit model weights to %s", path)
        comm.barrier()
        return True

    def destroy(self) -> None:
        """Release what outlives Python's garbage collection: NVMe swap files (also removed at
        interpreter exit, normal or by an exception; DeepSpeed's name)."""
        self.strategy.close()

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
        return dict(self.last_step_report) if self.last_step_report is not None else None

    @property
    def flops_profile(self) -> dict | None:
        """The flops profiler's result (`flops_profiler.enabled`; None until its micro-batch ran):
        FLOPs and seconds of the forward and the backward, and per module (`modules`) its parameters,
        forward FLOPs and forward latency. zerodp/profiler.py's [Note: the flops profile]."""
        return self.flops_profiler.profile

    def memory_report(self) -> dict:
        """Bytes this rank holds, by category and tier ("device", "cpu" when offloaded, "nvme"; see
        zerodp.memory), plus transient peaks, plus `activations`: what autograd saved for backward
        at the peak of the last step, by tier (zerodp.checkpointing's [Note: counting saved
        activations])."""
        device = self.device.type
        activations = {("device" if tier == device else tier): b for tier, b in self.saved_activations_peak.items()}
        return {**self.strategy.ledger().report(), "activations": activations}

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

    def comm_report(self) -> dict:
        """This engine's collectives (not those of another engine in the process) per op and dtype, in
        elements and bytes: of its last optimizer step, of its start-up, and one-off work between steps
        (stage 0's layout rebuild after step 1). See [Note: one comm ledger per engine]."""
        ledger = self.comm_ledger
        return {"last_step": comm.comm_report(ledger.last_step), "init": comm.comm_report(ledger.init),
                "one_off": comm.comm_report(ledger.one_off)}


def _on_host(section: Any) -> bool:
    """Whether an offload section (offload_optimizer / offload_param) puts its tensors on the host
    (device cpu, or nvme: swapped through host memory)."""
    return section is not None and section.device in ("cpu", "nvme")


def _clear_strategy_grads_on_module_zero_grad(module: nn.Module, engine: Engine) -> None:
    """`module.zero_grad()` also drops the gradients the strategy accumulated in its own buffers, as
    it drops `.grad` in plain PyTorch (a GAN script zeroes the discriminator's gradients, which the
    generator's backward produced, with `netD.zero_grad()`)."""
    module_zero_grad = module.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        module_zero_grad(set_to_none)
        engine.zero_grad()

    module.zero_grad = zero_grad


def _tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward's output (tensors, and tuples, lists and dicts of them)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors_in(item)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_floats(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_floats(v, dtype) for k, v in tree.items()}
    return tree


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


_OFFLOAD_KINDS = {"optim_states": (Category.OPTIM_STATE,), "hp_params": (Category.PARAM32_MASTER,),
                  "lp_params": (Category.PARAM16,), "lp_grads": (Category.GRAD,),
                  "contiguous_grad_buffer": (Category.GRAD,)}
"""DeepSpeed's OffloadStateTypeEnum values -> the ledger categories they name."""


def _offload_kinds(include: Any) -> set[str]:
    """The state kinds `offload_states(include=...)` names (None: all), checked."""
    if include is None:
        return set(_OFFLOAD_KINDS)
    if isinstance(include, (str, bytes)) or not hasattr(include, "__iter__"):
        include = [include]
    kinds = {getattr(kind, "value", kind) for kind in include}
    unknown = sorted(str(k) for k in kinds - set(_OFFLOAD_KINDS))
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown state {unknown}; the states are "
                         f"{sorted(_OFFLOAD_KINDS)} (DeepSpeed's OffloadStateTypeEnum)")
    return kinds
