"""`zerodp.initialize`: DeepSpeed's entry point, with every user error raised before any collective."""

from __future__ import annotations

import os
import zlib
from typing import Any, Iterable

import torch
from torch import nn

from zerodp import checkpointing, comm, sequence
from zerodp.comm.launch_env import discover_launch_env
from zerodp.config import ZeroDPConfig, load_config
from zerodp.engine import Engine
from zerodp.log import log_rank0, show_on_stderr, warn_once
from zerodp.offload.cpu import Home, preflight_offload
from zerodp.optim import NoOptimizer, forward_only_reason, optimizer_factory, param_groups_from
from zerodp.precision import DtypePolicy
from zerodp.profiler import check_output_file
from zerodp.zero import strategy_class
from zerodp.zero.four_bit import check_4bit_storage, check_reentrant_checkpointing
from zerodp.zero.units import full_numel
from zerodp.plan import engines
from zerodp.plan.doctor import Doctor
from zerodp.plan.preflight import preflight_memory
from zerodp.zero.topology import node_layout


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Engine, torch.optim.Optimizer, Any, Any]:
    """Wrap `model` for ZeRO training; returns (engine, optimizer, training_dataloader, lr_scheduler).
    With no optimizer (none passed, none in the config), or none passed and every parameter frozen,
    the engine runs forward only: partitioned at stage 3, no gradients, masters or optimizer state.

    Args (DeepSpeed's signature):
        model: the torch.nn.Module to train.
        config: a path, dict, JSON string or ZeroDPConfig (or `args.deepspeed_config`;
            `config_params` is the legacy name).
        optimizer: None (built from the config's "optimizer"), a torch.optim.Optimizer, or a
            callable(param_groups) -> Optimizer.
        model_parameters: parameters or param-group dicts (default: the model's trainable ones).
        lr_scheduler: None (from the config's "scheduler"), a scheduler, or callable(optimizer).
        training_data: a Dataset; the third return value is then a DataLoader with a
            DistributedSampler and the micro batch size (None otherwise).
        dist_init_required: False to require an existing process group.
        mpu: a sequence-parallel groups provider only (DeepSpeed Ulysses' register_with_transformers).
    The config is validated before the process group is used, so a bad config fails on every
    rank with the same message instead of hanging the others.
    """
    _check_arguments(model, mpu, mesh_param, config, config_params)
    cfg = load_config(config if config is not None else config_params, args=args, world_size=_known_world_size(),
                      sequence_parallel_size=_sequence_parallel_size_of(mpu))
    policy = DtypePolicy.from_config(cfg)
    strategy_cls = strategy_class(cfg)
    forward_only = forward_only_reason(model, model_parameters, optimizer, cfg.optimizer)
    groups = [] if forward_only else param_groups_from(model, model_parameters, optimizer)
    _preflight(model, cfg, groups, forward_only)
    if dist_init_required is False and not comm.is_initialized():
        raise ValueError("dist_init_required=False but torch.distributed is not initialised")
    comm.init_distributed()
    device = comm.device_for_backend()
    comm_ledger = comm.CommLedger()  # the engine's own: start-up's collectives are its `init`
    with comm.recording(comm_ledger):
        _start_groups(model, cfg, device)
        strategy = strategy_cls(cfg, policy, device, comm_ledger)
        strategy.wrap(model, groups, _optimizer_maker(optimizer, cfg, device, forward_only))
        _warn_if_slow_offloaded_optimizer(strategy)
        scheduler = _scheduler_of(lr_scheduler, cfg, strategy, forward_only)
        if cfg.activation_checkpointing != type(cfg.activation_checkpointing)():
            checkpointing.configure(deepspeed_config=cfg)
        engine = Engine(model, cfg, strategy, scheduler, training_data, collate_fn)
    engine.watch_phases(Doctor(engine))  # out of memory in forward, backward or step: one report
    comm.end_init(comm_ledger)
    _announce(cfg, forward_only)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_arguments(model: nn.Module | None, mpu: Any, mesh_param: Any, config: Any, config_params: Any) -> None:
    if model is None:
        raise ValueError("initialize() needs model=")
    if mesh_param is not None or (mpu is not None and not hasattr(mpu, "get_sequence_parallel_world_size")):
        raise NotImplementedError("model parallelism (mpu=, mesh_param=) is not supported: zerodp is data-parallel "
                                  "only; an mpu= is accepted when it provides sequence-parallel groups (DeepSpeed's "
                                  "Ulysses: register_with_transformers returns one)")
    if mpu is not None and getattr(mpu, "get_model_parallel_world_size", mpu.get_sequence_parallel_world_size)() \
            != mpu.get_sequence_parallel_world_size():
        raise NotImplementedError("mpu= has model-parallel groups other than its sequence-parallel ones: zerodp "
                                  "has no tensor or pipeline parallelism")
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config= or config_params=, not both")


def _start_groups(model: nn.Module, cfg: ZeroDPConfig, device: torch.device) -> None:
    """The first collectives: the ranks agree, the node layout, the sequence-parallel groups."""
    _check_ranks_agree(model, cfg, device)
    nodes = node_layout()  # the comm ledger counts intra- and inter-node bytes apart
    comm.set_node_layout([nodes.node_of(r) for r in range(comm.get_world_size())])
    if cfg.sequence_parallel_size > 1:  # the groups register_with_transformers built, or new ones
        sequence.initialize_sequence_parallel(cfg.sequence_parallel_size)


def _sequence_parallel_size_of(mpu: Any) -> int | None:
    """The sequence-parallel size of DeepSpeed's `mpu=` (Ulysses' groups provider), None without one."""
    return None if mpu is None else int(mpu.get_sequence_parallel_world_size())


def _optimizer_maker(optimizer: Any, cfg: ZeroDPConfig, device: torch.device, forward_only: str | None) -> Any:
    """What the strategy builds its optimizer with, on the host when the optimizer is offloaded."""
    if forward_only:
        return lambda _: NoOptimizer(forward_only)
    optimizer_device = Home.for_section(device, cfg.zero_optimization.offload_optimizer).device
    if optimizer is not None and cfg.optimizer is not None:  # DeepSpeed also takes the script's, saying so
        warn_once(f"initialize(optimizer=...) was given and the config has an optimizer section ({cfg.optimizer.type}):"
                  " the script's optimizer is used, the config's is ignored")
    return optimizer_factory(optimizer, cfg.optimizer, optimizer_device)


def _preflight(model: nn.Module, cfg: ZeroDPConfig, groups: list[dict], forward_only: str | None) -> None:
    """What a user can get wrong that this rank can see alone, refused before any collective: partitions
    zerodp cannot read, an unwritable profile, model states or an offload that do not fit this machine."""
    _check_partitioning(model, cfg)
    check_4bit_storage(model, DtypePolicy.from_config(cfg).param_dtype, cfg.zero_optimization.stage)
    check_reentrant_checkpointing(model)
    if cfg.flops_profiler.enabled:
        check_output_file(cfg.flops_profiler.output_file)
    if not comm.simulated():  # this machine's memory says nothing about the one a simulation estimates
        preflight_offload(cfg, sum(full_numel(p) for g in groups for p in g["params"]))
        if not forward_only:  # an engine that trains: its model states are the estimator's
            preflight_memory(cfg, model, {p for g in groups for p in g["params"]}, cfg.batch.world_size)


def _announce(cfg: ZeroDPConfig, forward_only: str | None) -> None:
    """The one line (and with dump_state the resolved config) initialize logs on rank 0."""
    show_on_stderr(cfg.log_level)
    log_rank0("zerodp: stage %d, %s, %s", cfg.zero_optimization.stage, cfg.precision,
              f"forward only ({forward_only})" if forward_only else cfg.batch.describe())
    if cfg.dump_state:
        log_rank0("zerodp config, resolved (dump_state):\n%s", cfg.model_dump_json(indent=2, exclude_none=True))


def _warn_if_slow_offloaded_optimizer(strategy) -> None:
    """An offloaded Adam steps on the CPU: torch's default (foreach) is 5.8x slower than fused there."""
    optimizer = strategy.optimizer
    if strategy.home.offload and type(optimizer).__name__ in ("Adam", "AdamW") and not optimizer.defaults.get("fused"):
        warn_once(f"offload_optimizer steps {type(optimizer).__name__} on the CPU without fused=True: torch's fused "
                  "CPU kernel was 5.8x faster than foreach in bench/cpu_adam.py (and within 12% of DeepSpeed's "
                  "CPUAdam); build it with fused=True, or let the config's \"optimizer\" section build it")


def _check_partitioning(model: nn.Module, cfg: ZeroDPConfig) -> None:
    from zerodp.zero import is_partitioned

    foreign = [n for n, p in model.named_parameters() if hasattr(p, "ds_id") and not is_partitioned(p)]
    if foreign:
        raise ValueError(
            f"{len(foreign)} parameters (e.g. '{foreign[0]}') were partitioned by DeepSpeed's own zero.Init (they "
            "have DeepSpeed's ds_id, and zerodp did not partition them): zerodp cannot read DeepSpeed's partitions. "
            "Build the model under zerodp.zero.Init, or run with ZERODP_AS_DEEPSPEED=1 so that deepspeed.zero.Init "
            "is zerodp's")
    partitioned = [n for n, p in model.named_parameters() if is_partitioned(p)]
    if partitioned and cfg.zero_optimization.stage != 3:
        raise ValueError(
            f"{len(partitioned)} parameters (e.g. '{partitioned[0]}') are partitioned (built under zerodp.zero.Init, "
            f"or already trained by a stage-3 engine) but zero_optimization.stage is {cfg.zero_optimization.stage}: "
            "set stage 3, or build the model without zero.Init")


def _known_world_size() -> int | None:
    """The data-parallel size if it is known without guessing: the process group's, a Slurm or MPI
    launch's, or 1 for a script run without a launcher (init_distributed then makes a 1-rank group).
    None lets the config read $WORLD_SIZE (torchrun)."""
    if comm.is_initialized():
        return comm.get_world_size()
    launch = discover_launch_env(os.environ)
    return None if launch.source == "torchrun" else launch.world_size


def _scheduler_of(lr_scheduler: Any, cfg: ZeroDPConfig, strategy: Any, forward_only: str | None) -> Any:
    """The engine's lr scheduler; none for an engine that runs forward only (said once if one was asked for)."""
    if forward_only and (lr_scheduler is not None or cfg.scheduler is not None):
        warn_once(f"the engine runs forward only ({forward_only}): its lr scheduler is not built")
    return None if forward_only else _make_scheduler(lr_scheduler, cfg, strategy.optimizer)


def _make_scheduler(lr_scheduler: Any, cfg: ZeroDPConfig, optimizer: torch.optim.Optimizer) -> Any:
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    if lr_scheduler is not None:
        # An instance keeps working when it was built on the optimizer passed in (re-pointed in place).
        if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError(
                "lr_scheduler was built on a different optimizer than the one zerodp steps: pass the "
                "optimizer you built it on as optimizer=, or pass lr_scheduler as a callable(optimizer)"
            )
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    from zerodp.lr_schedules import build_scheduler

    return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), optimizer)


def _check_ranks_agree(model: nn.Module, cfg: ZeroDPConfig, device: torch.device) -> None:
    """First collective: every rank must have the same config and model shapes, else every rank
    raises naming the ranks that differ (instead of hanging or silently diverging later)."""
    if comm.get_world_size() == 1:
        return
    shapes = ";".join(f"{n}:{tuple(getattr(p, 'ds_shape', p.shape))}:{p.requires_grad}" for n, p in model.named_parameters())
    row = torch.tensor([zlib.crc32(cfg.model_dump_json().encode()), zlib.crc32(shapes.encode())],
                       dtype=torch.int64, device=device)
    rows = comm.all_gather_rows(row).tolist()
    for what, col in (("config", 0), ("model parameters (names, shapes, requires_grad)", 1)):
        differ = [r for r, got in enumerate(rows) if got[col] != rows[0][col]]
        if differ:
            raise ValueError(f"ranks {differ} have a different {what} from rank 0; every rank must build the same")


engines.provide(initialize)  # what plan/ builds its simulated and measured engines with (zerodp/plan/engines.py)
