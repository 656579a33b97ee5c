"""Cross-field rules of a DeepSpeed config, and the message helpers they share with
`zerodp.config`: the checks pydantic's per-field types cannot express (fp16 with bf16, offload at
the wrong stage, keys zerodp does not support)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from typing import Any

from zerodp.config.errors import show_value  # noqa: F401 (imported from here by the other config modules)
from zerodp.config.schema import ZeroDPConfig
from zerodp.log import warn_once

# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def did_you_mean(word: str, candidates: list[str]) -> str | None:
    """The candidate closest to `word` (case-insensitive match first), or None if none is close."""
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.7)
    return lowered[close[0]] if close else None


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours that turn `a` into `b`
    (Damerau-Levenshtein, optimal string alignment): "optimisation" -> "optimization" is 1."""
    previous, current = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, current = previous, current, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1] and before is not None:
                current[j] = min(current[j], before[j - 2] + 1)
    return current[len(b)]


def typo_of(word: str, candidates: list[str]) -> str | None:
    """The candidate `word` is a typo of, or None: equal ignoring case, or at most
    1 + len(word) // 10 edits away (`zero_optimisation`, `gradient_clipin`, `stage3_prefetch_buket_size`),
    the closest first. Stricter than `did_you_mean`: `fp8` is not a typo of `fp16`, nor
    `sequence_parallel` of `sequence_parallel_size`."""
    allowed = 1 + len(word) // 10
    scored = sorted((edit_distance(word.lower(), c.lower()), c) for c in candidates)
    return scored[0][1] if scored and scored[0][0] <= allowed else None


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
    """The window and the floor are read only by dynamic scaling (fp16 on, loss_scale 0), so only
    then are they checked: DeepSpeed accepts a disabled fp16 section carrying a 0 window."""
    fp16, problems = cfg.fp16, []
    if not fp16.enabled:
        return problems
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
             ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states))
    for path, enabled in flags:
        if enabled and stage == 0:
            problems.append(f"{path}: needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)")
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.append("bf16.bf16_optimizer_states: requires bf16.bf16_master_weights_and_grads: true")
    if cfg.bf16.bf16_master_weights_and_grads and not cfg.bf16.enabled:
        problems.append("bf16.bf16_master_weights_and_grads: needs bf16.enabled: true (it keeps bf16 weights "
                        "as the master copy)")
    if cfg.bf16.bf16_master_weights_and_grads and cfg.data_types.grad_accum_dtype == "fp32":
        problems.append('bf16.bf16_master_weights_and_grads: keeps gradients in bf16, but '
                        'data_types.grad_accum_dtype is "fp32"; remove one of them')
    return problems


def _offload_rules(cfg: ZeroDPConfig) -> list[str]:
    zero, problems = cfg.zero_optimization, []
    param, opt = zero.offload_param, zero.offload_optimizer
    where = "zero_optimization"
    if opt is not None and opt.device != "none" and zero.stage == 0:
        problems.append(f"{where}.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3 "
                        f"({where}.stage is 0)")
    if zero.sub_group_size == 0 and zero.stage in (1, 2) and opt is not None and opt.device == "nvme":
        problems.append(f"{where}.sub_group_size: 0 is DeepSpeed's one sub-group per parameter, a stage-3 setting "
                        "(DeepSpeed has no NVMe optimizer offload below stage 3); at stages 1-2 zerodp cuts each "
                        "group's owned shard into swap chunks of sub_group_size elements, which 0 cannot size: "
                        "set a chunk size, e.g. 1e8")
    for name, section in (("offload_param", param if zero.stage == 3 else None), ("offload_optimizer", opt)):
        if section is not None and section.device == "nvme" and not section.nvme_path:
            problems.append(f'{where}.{name}.nvme_path: required when device is "nvme" '
                            "(a directory on the NVMe drive)")
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
    return problems


def hierarchy_problems(cfg: ZeroDPConfig, world_size: int) -> list[str]:
    """zero_hpz_partition_size (ZeRO++ hpZ) and mics_shard_size (MiCS) against the stage and the
    data-parallel world size (zero/topology.py builds their groups)."""
    zero, where, problems = cfg.zero_optimization, "zero_optimization", []
    sizes = {key: size for key, size in (("zero_hpz_partition_size", zero.zero_hpz_partition_size),
                                          ("mics_shard_size", zero.mics_shard_size)) if size > 1}
    if zero.mics_shard_size == 1:
        problems.append(f"{where}.mics_shard_size: 1 would shard over one rank, i.e. replicate everything as DDP "
                        "does; use ZeRO stage 0 for that, or a shard size of the ranks per node (-1: off)")
    if len(sizes) == 2:
        problems.append(f"{where}.zero_hpz_partition_size, {where}.mics_shard_size: both are set; hpZ keeps a "
                        "secondary copy of the parameters per node, MiCS shards everything per group: choose one")
    for key, size in sizes.items():
        if cfg.sequence_parallel_size > 1:
            problems.append(f"{where}.{key} with sequence_parallel_size {cfg.sequence_parallel_size}: hierarchical "
                            "partitioning inside sequence parallelism is not implemented (ZeRO partitions over every "
                            "rank); drop one of them")
        elif zero.stage != 3:
            problems.append(f"{where}.{key}: {size} partitions ZeRO stage 3 hierarchically; it needs "
                            f"{where}.stage 3 (it is {zero.stage})")
        elif world_size % size:
            divisors = [d for d in range(2, world_size + 1) if world_size % d == 0]
            problems.append(f"{where}.{key}: {size} does not divide the data-parallel world size ({world_size}); "
                            "use the ranks per node" + (f", one of {divisors}" if size < world_size else
                                                        " (zerodp config check: give --world-size)"))
        elif zero.offload_param is not None and zero.offload_param.device != "none":
            problems.append(f"{where}.{key} with {where}.offload_param: hierarchical partitioning of offloaded "
                            "parameters is not implemented; drop one of them")
    return problems


def _quantized_collective_rules(cfg: ZeroDPConfig) -> list[str]:
    """ZeRO++ qwZ / qgZ (zero/quantized_comm.py): read at stage 3 only (below it DeepSpeed ignores them,
    and so does zerodp, with one warning), and not with MiCS or sequence parallelism (not built)."""
    zero, where, problems = cfg.zero_optimization, "zero_optimization", []
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if not getattr(zero, key):
            continue
        if zero.stage != 3:
            warn_once(f"{where}.{key}: true quantizes the collectives of ZeRO stage 3; at {where}.stage "
                      f"{zero.stage} it is ignored, as DeepSpeed ignores it (set the stage to 3 to use it)")
        elif zero.mics_shard_size > 1:
            problems.append(f"{where}.{key} with {where}.mics_shard_size {zero.mics_shard_size}: quantized "
                            "collectives with MiCS are not implemented; use zero_hpz_partition_size (hpZ) or drop one")
        elif cfg.sequence_parallel_size > 1:
            problems.append(f"{where}.{key} with sequence_parallel_size {cfg.sequence_parallel_size}: quantized "
                            "collectives with sequence parallelism are not implemented; drop one of them")
    return problems


def _autocast_rules(cfg: ZeroDPConfig) -> list[str]:
    section = cfg.torch_autocast
    if not section.enabled or section.dtype == "bf16":
        return []
    found = "unset (torch's default for the device: float16 on CUDA)" if section.dtype is None else \
        show_value(section.dtype)
    if section.dtype == "fp32":
        return [f"torch_autocast.dtype: {found} with enabled: true autocasts nothing; set \"bf16\", or "
                "enabled: false"]
    return [f"torch_autocast.dtype: {found}; zerodp autocasts to bf16 only (fp16 autocast needs a gradient "
            "scaler, which zerodp builds for the fp16 section alone); set \"dtype\": \"bf16\", or use the "
            "fp16 section instead of torch_autocast"]


DEEPCOMPILE_KEYS = ("deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold",
                    "offload_activation", "offload_activation_pin_memory", "offload_opt_states", "double_buffer",
                    "symmetric_memory", "debug_log", "offload_parameters", "sync_before_reduce", "sync_after_reduce",
                    "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors",
                    "keep_all_input_tensors", "passes")
"""DeepSpeed 0.19.8's `compile` keys: DeepCompile's, which act only with `deepcompile: true` (refused)."""
TORCH_COMPILE_FORM = {"disable": bool, "backend": str, "kwargs": dict}
"""The section's torch.compile form, which zerodp compiles with (zerodp/forward_policy.py)."""


def _compile_rules(cfg: ZeroDPConfig) -> list[str]:
    section, problems = cfg.compile or {}, []
    for key, value in section.items():
        if key in TORCH_COMPILE_FORM:
            if not isinstance(value, TORCH_COMPILE_FORM[key]):
                problems.append(f"compile.{key}: got {show_value(value)}; expected a "
                                f"{TORCH_COMPILE_FORM[key].__name__}")
        elif key not in DEEPCOMPILE_KEYS:
            problems.append(f"compile.{key}: not a key of the compile section (DeepSpeed refuses it too); "
                            f"expected one of disable, backend, kwargs (torch.compile) or DeepCompile's "
                            f"{', '.join(DEEPCOMPILE_KEYS)}{hint(key, [*TORCH_COMPILE_FORM, *DEEPCOMPILE_KEYS])}")
    return problems


# Each rule with the key paths it reads: a rule is skipped when one of them failed validation.
_RULES: tuple[tuple[tuple[str, ...], Callable[[ZeroDPConfig], list[str]]], ...] = (
    (("fp16.enabled", "bf16.enabled"), _one_precision),
    (("fp16.loss_scale", "fp16.loss_scale_window", "fp16.min_loss_scale"), _dynamic_scale),
    (("bf16.bf16_master_weights_and_grads", "bf16.enabled",
      "bf16.bf16_optimizer_states", "zero_optimization.stage", "data_types.grad_accum_dtype"),
     _master_weight_rules),
    (("zero_optimization.stage", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
      "zero_optimization.sub_group_size"), _offload_rules),

    (("optimizer.params.max_grad_norm", "log_level"), _misc_rules),
    (("zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients",
      "zero_optimization.stage", "zero_optimization.mics_shard_size", "sequence_parallel_size"),
     _quantized_collective_rules),
    (("torch_autocast.enabled", "torch_autocast.dtype"), _autocast_rules),
    (("compile",), _compile_rules),
)


def semantic_problems(cfg: ZeroDPConfig, usable: Callable[..., bool] = lambda *paths: True) -> list[str]:
    """Problems no single key shows: cross-field rules and features zerodp does not implement
    (optimizer and scheduler parameters are `zerodp.config.hparams`'). `usable(*paths)` says whether
    those keys validated; a rule reading a key that failed is skipped (its default would mislead)."""
    problems: list[str] = []
    for paths, rule in _RULES:
        if usable(*paths):
            problems.extend(rule(cfg))
    return problems
