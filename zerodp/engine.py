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
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerodp import checkpointing, comm
from zerodp.accumulation import AccumulationClock
from zerodp.checkpoint.async_save import AsyncCheckpointer
from zerodp.config import ZeroDPConfig
from zerodp.data import ResumableDistributedSampler
from zerodp.engine_accessors import EngineAccessors
from zerodp.engine_checkpoints import EngineCheckpoints
from zerodp.forward_policy import DEFAULT_COMPILE_BACKEND, ForwardPolicy, compile_from_config
from zerodp.log import log_rank0, logger
from zerodp.memory import DEVICE, Category
from zerodp.offload.park import ParkedStorages
from zerodp.optim import NoOptimizer
from zerodp.precision import make_loss_scaler, overflow_message
from zerodp.step_reporter import StepReporter
from zerodp.timers import ThroughputTimer, Timers
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


class Engine(EngineAccessors, EngineCheckpoints, nn.Module):
    """DeepSpeed's engine API over a zerodp Strategy. Build it with `zerodp.initialize`.

    The loop (forward / backward / step) runs around one AccumulationClock (`engine.accumulation`,
    zerodp/accumulation.py), shared with the strategy; what it reports about each step is the
    StepReporter's (`engine.reporter`, zerodp/step_reporter.py); DeepSpeed's accessors and the
    checkpoints are mixins (zerodp/engine_accessors.py, zerodp/engine_checkpoints.py)."""

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
        self.reporter = StepReporter(module, config, strategy, self.timers)  # step_report(), last_metrics, flops
        # which micro-batch is the boundary, no_sync, plain loss.backward() passes: [Note: the accumulation boundary]
        self.accumulation = AccumulationClock(config.gradient_accumulation_steps,
                                              config.managed_gradient_accumulation, comm.get_rank())
        strategy.follow(self.accumulation)
        self._forwards = 0  # forward calls: a forward-only engine's flops profiler counts them
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._global_grad_norm: float | None = None
        self._param_storages = checkpointing.storage_keys(strategy.parameter_storages())  # not activations
        # count what autograd saves in each forward (memory_report()["activations"]); off for engines built
        # through `deepspeed.initialize` unless memory_breakdown asks ([Note: counting saved activations])
        self.count_activations = True
        self._saved_peak: dict[str, int] = {}  # saved-activation bytes, this step's largest micro-batch
        self.saved_activations_peak: dict[str, int] = {}  # ... of the last completed step
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
        self.doctor: PhaseWatcher = UNWATCHED  # api.initialize installs the OOM doctor (watch_phases)
        self.async_saves = AsyncCheckpointer()  # saves written in the background: [Note: async checkpoint commit]
        self._async_save_default = config.checkpoint.async_save
        _clear_strategy_grads_on_module_zero_grad(module, self)
        self.forward_policy = ForwardPolicy(config, module, strategy.device)  # torch_autocast, compile
        compile_from_config(self.forward_policy, config.compile)

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

    # --- the accumulation boundary ([Note: the accumulation boundary]) -------------------------

    @property
    def micro_steps(self) -> int:
        """step() calls so far (DeepSpeed's counter; saved in checkpoints)."""
        return self.accumulation.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.accumulation.micro_steps = value

    @property
    def micro_steps_in_step(self) -> int:
        """Micro-batches taken since the last accumulation boundary (saved in checkpoints)."""
        return self.micro_steps % self.gradient_accumulation_steps()

    @micro_steps_in_step.setter
    def micro_steps_in_step(self, position: int) -> None:
        """After a load (global_steps restored first): count micro-steps as this run's accumulation would, so
        a run resumed with another gradient_accumulation_steps (another world size) steps at its own
        boundaries, not at those of the saved run's count."""
        if position < self.gradient_accumulation_steps():
            self.micro_steps = self.global_steps * self.gradient_accumulation_steps() + position

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-batch whose backward completes an optimizer step."""
        return self.accumulation.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force the boundary on or off (None: back to counting micro-batches)."""
        self.accumulation.force_boundary(is_boundary)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates without communicating; step() inside is an error. Not
        available at stage 2, which reduces (and frees) gradients in every backward."""
        if self.strategy.reduces_every_micro_batch:
            raise RuntimeError(f"no_sync() is not possible at ZeRO stage {self.zero_optimization_stage()}: "
                               "it reduces gradients in every backward; use stage 0 or 1")
        with self.accumulation.no_sync():
            yield

    # --- the loop -----------------------------------------------------------------------------

    @comm.records_to_own_ledger
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (inputs cast to fp16 when `fp16.auto_cast`; under torch.autocast when
        `torch_autocast` is enabled: zerodp/forward_policy.py)."""
        self._check_resident("forward")
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        # a forward-only engine has no steps to report (and its clock would keep every forward's marks)
        timed = self.reporter.clock.phase("forward") if not self.forward_only else nullcontext()
        with timed, self.timers("fwd"), self._explained_errors(), self.doctor.watching("forward"), \
                checkpointing.count_saved_activations(self._param_storages, self.count_activations) as saved, \
                self.reporter.flops_profiler.forward(self._forwards if self.forward_only else self.global_steps,
                                            backward=not self.forward_only), self.forward_policy.autocast():
            out = self.module(*args, **kwargs)
        self._forwards += 1
        if saved.total > sum(self._saved_peak.values()):
            self._saved_peak = dict(saved.bytes_by_tier)
        if self.config.gradient_accumulation_steps > 1 and torch.is_grad_enabled():
            self._divide_direct_backward_by_accumulation(out)
        return out

    def compile(self, backend: Any = DEFAULT_COMPILE_BACKEND, compile_kwargs: dict | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the module in place with torch.compile (DeepSpeed's signature; zerodp/forward_policy.py)."""
        self.forward_policy.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` (or the config's compile section) compiled the module."""
        return self.forward_policy.is_compiled

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
        boundary = self.accumulation.backward_boundary()
        gas = self.config.gradient_accumulation_steps
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        self.reporter.note_loss(loss)
        with self.reporter.clock.phase("backward"), self.timers("bwd"), self._explained_errors(), \
                self.doctor.watching("backward"):
            self.strategy.begin_backward(boundary)
            to_backward = scaled * self.loss_scaler.loss_scale if self.loss_scaler.loss_scale != 1.0 else scaled
            global _engine_backwards_running
            _engine_backwards_running += 1
            try:
                with self.reporter.flops_profiler.backward():
                    to_backward.backward(retain_graph=retain_graph)
            except BaseException:
                self.strategy.abort_backward()
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
        self.accumulation.count_scaled_loss()
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
        if self.accumulation.in_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave no_sync before the boundary step")
        self._check_resident("step")
        self._check_trains("step")
        with self.accumulation.stepping():  # counts the micro-batch when the step completes
            if self.accumulation.is_boundary():
                self.reporter.flops_profiler.finish()  # a profiled forward whose backward was not engine.backward
                with self.reporter.clock.phase("step"), self.timers("step"), self.doctor.watching("step"):
                    scale = self._take_model_step(lr_kwargs)
                self.tput_timer.step_finished()
                self._record_metrics(scale)
                self.async_saves.poll()  # publish a finished async save; raise a failed one on every rank
        self.tput_timer.micro_step_finished()

    def _take_model_step(self, lr_kwargs: dict | None) -> float:
        """The boundary's work; returns the loss scale the step ran with."""
        if self.config.fp16.enabled and self.accumulation.unscaled_implicit_backwards():
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

    def _record_metrics(self, scale: float) -> None:
        """After a boundary step: the reporter's step report and metrics; this step's activation peak."""
        self.reporter.record(self.global_steps, scale, self._global_grad_norm if self._step_applied else None,
                             self.get_lr()[0], self.memory_report)
        self.saved_activations_peak, self._saved_peak = self._saved_peak, {}

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the boundary step already does this; `engine.module.zero_grad()`
        does it too)."""
        self.strategy.zero_grad()
        self.accumulation.restart()

    # --- data and reports ---------------------------------------------------------------------

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> DataLoader:
        """A DataLoader giving this rank its share of `dataset` (DeepSpeed's signature): a shuffled
        sampler that checkpoints record the position of (zerodp.data), unless `data_sampler` is
        given; `batch_size` = the micro batch; with sequence parallelism, one share per data-parallel
        replica (zerodp.sequence.shard_batch cuts each rank's piece of the sequence). Call `loader.sampler.set_epoch(epoch)` each epoch
        for a new order."""
        sampler = data_sampler or ResumableDistributedSampler(
            # the ranks of one sequence-parallel group read the same samples ([Note: sequence-parallel groups])
            dataset, num_replicas=self.config.world_size, rank=comm.get_rank() // self.config.sequence_parallel_size,
            shuffle=route == "train", drop_last=self.config.dataloader_drop_last,
        )
        return DataLoader(
            dataset, batch_size=batch_size or self.config.train_micro_batch_size_per_gpu, sampler=sampler,
            collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda", drop_last=self.config.dataloader_drop_last,
        )

    # --- freeing the device between phases (RLHF) ---------------------------------------------

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move this rank's training state off the device into host memory until `reload_states()`
        (DeepSpeed's method: RLHF loops free the device for generation between training phases).
        `include`: which of "optim_states" (optimizer state), "hp_params" (fp32 masters; in fp32
        training the parameters themselves), "lp_params" (16-/4-bit parameters, quant_state), "lp_grads" and
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

    def destroy(self) -> None:
        """Release what outlives Python's garbage collection: NVMe swap files (also removed at
        interpreter exit, normal or by an exception; DeepSpeed's name), after publishing an async save in flight."""
        self.async_saves.wait()
        self.strategy.close()

    def memory_report(self) -> dict:
        """Bytes this rank holds, by category and tier ("device", "cpu" when offloaded, "nvme"; see
        zerodp.memory), plus transient peaks, plus `activations`: what autograd saved for backward
        at the peak of the last step, by tier (zerodp.checkpointing's [Note: counting saved
        activations])."""
        device = self.device.type
        activations = {("device" if tier == device else tier): b for tier, b in self.saved_activations_peak.items()}
        return {**self.strategy.ledger().report(), "activations": activations}

    def comm_report(self) -> dict:
        """This engine's collectives (not those of another engine in the process) per op and dtype, in
        elements and bytes: of its last optimizer step, of its start-up, and one-off work between steps
        (stage 0's layout rebuild after step 1). See [Note: one comm ledger per engine]."""
        ledger = self.comm_ledger
        return {"last_step": comm.comm_report(ledger.last_step), "init": comm.comm_report(ledger.init),
                "one_off": comm.comm_report(ledger.one_off)}


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
                  "lp_params": (Category.PARAM16, Category.PARAM_4BIT, Category.QUANT_STATE),  # 4-bit: + its state
                  "lp_grads": (Category.GRAD,), "contiguous_grad_buffer": (Category.GRAD,)}
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
