"""Cross-field rules of a DeepSpeed config, and the message helpers they share with
`zerodp.config`: the checks pydantic's per-field types cannot express (fp16 with bf16, offload at
the wrong stage, keys zerodp does not support)."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from typing import Any

from zerodp.config_schema import PIPELINE_DEFAULTS, ZeroDPConfig
from zerodp.log import warn_once

# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def show_value(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "abc"), shortened if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: str, candidates: list[str]) -> str | None:
    """The candidate closest to `word` (case-insensitive match first), or None if none is close."""
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.7)
    return lowered[close[0]] if close else None


def hint(word: str, candidates: list[str]) -> str:
    """"; did you mean 'x'?" for the closest candidate, or "" if none is close."""
    match = did_you_mean(word, candidates)
    return f"; did you mean '{match}'?" if match else ""


# ---------------------------------------------------------------------------------------------
# Cross-field rules
# ---------------------------------------------------------------------------------------------


def _one_precision(cfg: ZeroDPConfig) -> list[str]:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        return ["fp16.enabled, bf16.enabled: both are true; enable one of them "
                "(DeepSpeed refuses this too)"]
    return []


def _dynamic_scale(cfg: ZeroDPConfig) -> list[str]:
    fp16, problems = cfg.fp16, []
    if fp16.loss_scale == 0 and fp16.loss_scale_window <= 0:
        problems.append(f"fp16.loss_scale_window: got {fp16.loss_scale_window}; expected a value > 0 "
                        "with dynamic loss scaling (fp16.loss_scale 0)")
    if fp16.loss_scale == 0 and fp16.min_loss_scale <= 0:
        problems.append(f"fp16.min_loss_scale: got {show_value(fp16.min_loss_scale)}; expected a value > 0 "
                        "with dynamic loss scaling (fp16.loss_scale 0)")
    return problems


def _master_weight_rules(cfg: ZeroDPConfig) -> list[str]:
    stage, problems = cfg.zero_optimization.stage, []
    flags = (("bf16.bf16_master_weights_and_grads", cfg.bf16.bf16_master_weights_and_grads),
             ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states),
             ("fp16.fp16_master_weights_and_grads", cfg.fp16.fp16_master_weights_and_grads))
    for path, enabled in flags:
        if enabled and stage == 0:
            problems.append(f"{path}: needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)")
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.append("bf16.bf16_optimizer_states: requires bf16.bf16_master_weights_and_grads: true")
    offload = cfg.zero_optimization.offload_optimizer
    if cfg.fp16.fp16_master_weights_and_grads and (offload is None or offload.device == "none"):
        problems.append("fp16.fp16_master_weights_and_grads: needs zero_optimization.offload_optimizer "
                        '(device "cpu" or "nvme"), as in DeepSpeed')
    return problems


def _offload_rules(cfg: ZeroDPConfig) -> list[str]:
    zero, problems = cfg.zero_optimization, []
    param, opt = zero.offload_param, zero.offload_optimizer
    where = "zero_optimization"
    if param is not None and param.device != "none" and zero.stage != 3:
        problems.append(f"{where}.offload_param: parameter offload needs ZeRO stage 3 "
                        f"({where}.stage is {zero.stage}); set stage 3 or remove offload_param")
    if opt is not None and opt.device != "none" and zero.stage == 0:
        problems.append(f"{where}.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3 "
                        f"({where}.stage is 0)")
    if opt is not None and opt.device != "none" and opt.ratio < 1:
        problems.append(f"{where}.offload_optimizer.ratio: got {opt.ratio}; partial offload (ratio < 1) is not "
                        "implemented in zerodp: remove the key (everything is offloaded)")
    for name, section in (("offload_param", param), ("offload_optimizer", opt)):
        if section is not None and section.device == "nvme" and not section.nvme_path:
            problems.append(f'{where}.{name}.nvme_path: required when device is "nvme" '
                            "(a directory on the NVMe drive)")
    return problems


def _zero_rules(cfg: ZeroDPConfig) -> list[str]:
    zero, problems = cfg.zero_optimization, []
    if not zero.compute_grad_norm and zero.stage not in (1, 2):
        problems.append(f"zero_optimization.compute_grad_norm: false is only allowed at ZeRO stage 1 "
                        f"or 2 (stage is {zero.stage})")
    if zero.legacy_stage1:
        problems.append("zero_optimization.legacy_stage1: DeepSpeed removed the legacy stage-1 "
                        "implementation and raises on true; delete the key")
    return problems


def _misc_rules(cfg: ZeroDPConfig) -> list[str]:
    problems = []
    params = cfg.optimizer.params if cfg.optimizer is not None else {}
    if "max_grad_norm" in params:
        problems.append(f"optimizer.params.max_grad_norm: not an optimizer parameter; set the "
                        f"top-level \"gradient_clipping\": {show_value(params['max_grad_norm'])} instead "
                        "(DeepSpeed rejects it too)")
    if cfg.log_level is not None and logging.getLevelName(cfg.log_level.upper()) not in range(0, 51):
        problems.append(f"log_level: got {show_value(cfg.log_level)}; expected one of debug, info, "
                        "warning, error, critical")
    if cfg.vocabulary_size is not None and cfg.vocabulary_size % 8:
        warn_once(f"vocabulary_size {cfg.vocabulary_size} is not a multiple of 8; padding it to one "
                  "lets matrix multiplies use tensor cores")
    return problems


# Features zerodp does not implement, accepted at their defaults only: (path, value, default, why).
_ZEROPP = ("ZeRO++ quantized communication needs DeepSpeed's CUDA quantization kernels; zerodp "
           "communicates in the training dtype")
_PIPE = "zerodp is data-parallel only: no pipeline parallelism"
_MONITOR = ("DeepSpeed's monitor backends are not built in; log the per-step metrics dict "
            "the engine returns yourself")
_SECTIONS = {  # section: (switch key, why)
    "autotuning": ("enabled", "autotuning drives DeepSpeed's experiment launcher; use `zerodp plan`"),
    "tensorboard": ("enabled", _MONITOR), "wandb": ("enabled", _MONITOR),
    "csv_monitor": ("enabled", _MONITOR), "comet": ("enabled", _MONITOR),
    "hybrid_engine": ("enabled", "the RLHF hybrid engine swaps in DeepSpeed's inference kernels"),
    "data_efficiency": ("enabled", "curriculum learning and data routing belong in the data loader"),
    "compile": ("deepcompile", "DeepCompile is DeepSpeed's compiler pass; zerodp runs eagerly"),
    "expert_parallel": ("enabled", "zerodp is data-parallel only: no expert parallelism"),
    "datastates": ("enabled", "the DataStates checkpoint engine is not built in"),
}


# Gradient-reduction keys whose non-default values no strategy honours.
_REDUCTION_DEFAULTS = {"gradient_allreduce_op": "mean", "prescale_gradients": False,
                       "gradient_predivide_factor": 1.0, "communication_data_type": None}
# Stage-3 keys zerodp accepts at DeepSpeed's default only (docs/stage3.md says why).
_STAGE3_DEFAULTS = {"stage3_max_reuse_distance": (1_000_000_000, "units are not kept between calls"),
                    "stage3_module_granularity_threshold": (0, "units are chosen by module (set_z3_leaf_modules)"),
                    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are fetched with all-gather")}


def _unsupported_values(cfg: ZeroDPConfig) -> list[tuple[str, Any, Any, str]]:
    zero = cfg.zero_optimization
    opt = zero.offload_optimizer
    found = [
        ("zero_optimization.zero_quantized_weights", zero.zero_quantized_weights, False, _ZEROPP),
        ("zero_optimization.zero_quantized_nontrainable_weights",
         zero.zero_quantized_nontrainable_weights, False, _ZEROPP),
        ("zero_optimization.zero_quantized_gradients", zero.zero_quantized_gradients, False, _ZEROPP),
        ("zero_optimization.zenflow", zero.zenflow, None,
         "ZenFlow's stale-gradient CPU update is not implemented"),
        ("aio.use_gds", cfg.aio.use_gds, False, "GPUDirect Storage needs DeepSpeed's CUDA I/O op"),
        ("checkpoint.writer", cfg.checkpoint.writer, None, "zerodp writes its own checkpoint format"),
        ("checkpoint.parallel_write.pipeline_stage", cfg.checkpoint.parallel_write.pipeline_stage,
         False, _PIPE),
        ("sequence_parallel_size", cfg.sequence_parallel_size, 1, "no sequence parallelism"),
        ("seq_parallel_comm_data_type", cfg.seq_parallel_comm_data_type, "fp32", "no sequence parallelism"),
        ("use_data_before_expert_parallelism", cfg.use_data_before_expert_parallelism, False,
         "no expert parallelism"),
        ("weight_quantization", cfg.weight_quantization, None, "weight quantization is an inference feature"),
    ]
    found += [(key, getattr(cfg, key), default, "zerodp averages gradients in the accumulation dtype "
               "(data_types.grad_accum_dtype)") for key, default in _REDUCTION_DEFAULTS.items()]
    if zero.stage == 3:
        found += [(f"zero_optimization.{key}", getattr(zero, key), default, why)
                  for key, (default, why) in _STAGE3_DEFAULTS.items()]
    if opt is not None:
        found.append(("zero_optimization.offload_optimizer.super_offload", opt.super_offload, False,
                      "SuperOffload targets Grace-Hopper superchips with DeepSpeed's C++ optimizer"))
    if zero.zero_hpz_partition_size > 1:
        found.append(("zero_optimization.zero_hpz_partition_size", zero.zero_hpz_partition_size, 1,
                      "ZeRO++ hierarchical partitioning (hpZ) is not implemented"))
    return [item for item in found if item[1] != item[2]]


def _unsupported_sections(cfg: ZeroDPConfig) -> list[tuple[str, Any, Any, str]]:
    found = []
    for name, (switch, why) in _SECTIONS.items():
        section = getattr(cfg, name) or {}
        if section.get(switch, False) not in (False, None):
            found.append((f"{name}.{switch}", section[switch], False, why))
    tp_size = (cfg.tensor_parallel or {}).get("autotp_size", 0)
    if tp_size not in (0, 1):
        found.append(("tensor_parallel.autotp_size", tp_size, 1,
                      "zerodp is data-parallel only: no tensor parallelism"))
    for key, value in (cfg.pipeline or {}).items():
        default = PIPELINE_DEFAULTS.get(key, "(no such pipeline key)")
        if value != default:
            found.append((f"pipeline.{key}", value, default, _PIPE))
    return found


def _unsupported_rules(cfg: ZeroDPConfig) -> list[str]:
    return [f"{path}: {show_value(value)} is not supported by zerodp ({why}); remove it or set "
            f"{show_value(default)}" for path, value, default, why
            in _unsupported_values(cfg) + _unsupported_sections(cfg)]


# Each rule with the key paths it reads: a rule is skipped when one of them failed validation.
_RULES: tuple[tuple[tuple[str, ...], Callable[[ZeroDPConfig], list[str]]], ...] = (
    (("fp16.enabled", "bf16.enabled"), _one_precision),
    (("fp16.loss_scale", "fp16.loss_scale_window", "fp16.min_loss_scale"), _dynamic_scale),
    (("fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
      "bf16.bf16_optimizer_states", "zero_optimization.stage", "zero_optimization.offload_optimizer"),
     _master_weight_rules),
    (("zero_optimization.stage", "zero_optimization.offload_param", "zero_optimization.offload_optimizer"),
     _offload_rules),
    (("zero_optimization.stage", "zero_optimization.compute_grad_norm"),
     _zero_rules),
    (("optimizer.params.max_grad_norm", "log_level", "vocabulary_size"), _misc_rules),
    ((), _unsupported_rules),
)


def semantic_problems(cfg: ZeroDPConfig, usable: Callable[..., bool] = lambda *paths: True) -> list[str]:
    """Problems no single key shows: cross-field rules and features zerodp does not implement
    (optimizer and scheduler parameters are `zerodp.config_hparams`'). `usable(*paths)` says whether
    those keys validated; a rule reading a key that failed is skipped (its default would mislead)."""
    problems: list[str] = []
    for paths, rule in _RULES:
        if usable(*paths):
            problems.extend(rule(cfg))
    return problems
