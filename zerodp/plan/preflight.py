"""The preflight: before any rank communicates, refuse a run whose model states alone do not fit.

`initialize` estimates the model states of the run it is about to start (zerodp/plan/model_states.py:
exact, the ledger's own figures) and compares what lands on the device with the memory it may use:
$ZERODP_DEVICE_MEMORY_LIMIT when set (a shared GPU, or a test on a CPU), else on CUDA the free memory
of this rank's GPU (`torch.cuda.mem_get_info`). Over the limit, every rank raises the same error (each
computes rank 0's figure, the largest, from the same inputs: no collective) naming the figures and the
strategies that would fit. Activations and transient buffers come on top and are not estimated yet, so
the check only refuses runs that cannot fit; $ZERODP_PREFLIGHT=0 skips it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerodp.memory import DEVICE
from zerodp.plan.model_states import StrategySpec, buffer_bytes, every_strategy, flat_states, module_flats
from zerodp.sizes import decimal_size, parse_size

LIMIT_ENV, SWITCH_ENV = "ZERODP_DEVICE_MEMORY_LIMIT", "ZERODP_PREFLIGHT"


class PreflightError(ValueError):
    """The run's model states alone exceed the device memory it may use."""


def limit_from_env() -> int | None:
    """The bytes $ZERODP_DEVICE_MEMORY_LIMIT sets (ValueError naming it when unreadable), or None."""
    text = os.environ.get(LIMIT_ENV)
    return parse_size(text, what=f"${LIMIT_ENV}") if text else None


def device_memory_limit(module: torch.nn.Module) -> tuple[int, str] | None:
    """(bytes the run may use on its device, where that figure comes from), or None when unknown. On
    CUDA: the free memory plus what `module` already holds there (the engine reuses or frees it)."""
    limit = limit_from_env()
    if limit is not None:
        return limit, f"${LIMIT_ENV}={os.environ[LIMIT_ENV]}"
    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0"))
        free, _ = torch.cuda.mem_get_info(device)
        held = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
                   if t.device == torch.device("cuda", device))
        return free + held, f"cuda:{device} (free memory and the model's own tensors there)"
    return None


def preflight_memory(config: Any, module: torch.nn.Module, trainable: set, world_size: int) -> None:
    """PreflightError when the model states `config` puts on the device exceed the limit."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return
    limit = device_memory_limit(module)
    if limit is None:
        return
    limit_bytes, source = limit
    needed = device_bytes(config, module, trainable, world_size, strategy_of(config))
    if needed <= limit_bytes:
        return
    fits = [(s, b) for s in every_strategy(config.precision)
            if (b := device_bytes(config, module, trainable, world_size, s)) <= limit_bytes]
    alternatives = ", ".join(f"{s.describe()} ({decimal_size(b)})" for s, b in sorted(fits, key=lambda x: -x[1])[:4])
    raise PreflightError(
        f"initialize() refused to start: the model states alone need {decimal_size(needed)} per rank on the device at "
        f"{strategy_of(config).describe()} ({world_size} ranks, {config.precision}), more than the "
        f"{decimal_size(limit_bytes)} of {source}; activations and buffers come on top. "
        + (f"Strategies whose model states fit: {alternatives}. " if fits else
           "No strategy's model states fit at this world size: use more ranks. ")
        + f"(`zerodp estimate` shows every strategy; {SWITCH_ENV}=0 skips this check)")


def strategy_of(config: Any) -> StrategySpec:
    """The estimator's StrategySpec of a loaded config."""
    zero = config.zero_optimization
    devices = [getattr(section, "device", "none") if section is not None else "none"
               for section in (zero.offload_optimizer, zero.offload_param)]
    return StrategySpec(zero.stage, devices[0], devices[1] if zero.stage == 3 else "none", config.precision)


def device_bytes(config: Any, module: torch.nn.Module, trainable: set, world_size: int, s: StrategySpec) -> int:
    """Model-state bytes `s` puts on the device for `module` under `config`'s thresholds."""
    zero = config.zero_optimization
    flats = module_flats(module, s.stage, world_size, int(zero.stage3_param_persistence_threshold),
                         int(zero.stage3_model_persistence_threshold), s.offload_param, trainable)
    max_in_cpu = int(zero.offload_param.max_in_cpu) if zero.offload_param is not None else 1_000_000_000
    states = flat_states(flats, world_size, s, param_max_in_cpu=max_in_cpu, buffer_bytes=buffer_bytes(module),
                         hpz_partition_size=int(zero.zero_hpz_partition_size))  # hpZ's secondary copy
    return states.bytes(DEVICE)
