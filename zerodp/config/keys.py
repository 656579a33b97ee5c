"""The fate of every DeepSpeed config key that no zerodp code reads: refused unless it has
DeepSpeed's default (a feature zerodp does not implement), or accepted with a warning that it
changes nothing here (a DeepSpeed tuning knob whose job zerodp does another way, or always).

No key is accepted and then silently ignored: tests/test_config_keys.py runs the engine over a
matrix of configs, records every key the code reads, and checks that each key the schema accepts
is read or listed here; docs/config.md renders these tables.
"""

from __future__ import annotations

from typing import Any

from zerodp.config.schema import PIPELINE_DEFAULTS, ZeroDPConfig
from zerodp.config.rules import show_value
from zerodp.log import warn_once

_ZEROPP_FROZEN = ("storing frozen weights quantized is not implemented; zero_quantized_weights quantizes the "
                  "all-gathers of every weight, frozen ones included, and keeps the shards in the working dtype")
_PIPE = "zerodp is data-parallel only: no pipeline parallelism"
_REDUCE = "zerodp averages gradients in the accumulation dtype (data_types.grad_accum_dtype)"
_MONITOR = "DeepSpeed's monitor backends are not built in; log the per-step metrics dict the engine returns yourself"
_SUPER = "a SuperOffload (Grace-Hopper) setting; zerodp's offloaded step is torch's fused CPU optimizer"

NOT_IMPLEMENTED: dict[str, tuple[Any, str]] = {
    # path: (the value(s) accepted, why others are refused)
    "zero_optimization.zero_quantized_nontrainable_weights": (False, _ZEROPP_FROZEN),
    "zero_optimization.mics_hierarchical_params_gather": (False, "MiCS's two-hop parameter gather is not "
                                                                 "implemented: gathers stay inside the shard group"),
    "zero_optimization.zenflow": (None, "ZenFlow's stale-gradient CPU update is not implemented"),
    "zero_optimization.offload_optimizer.super_offload": (False, _SUPER),
    "zero_optimization.offload_optimizer.ratio": (1.0, "partial offload (ratio < 1) is not implemented: everything "
                                                       "is offloaded"),
    "zero_optimization.compute_grad_norm": (True, "zerodp computes the gradient norm in the same pass as the "
                                                  "overflow check, so there is nothing to skip"),
    "zero_optimization.ignore_unused_parameters": (True, "zerodp gives a parameter that got no gradient a zero "
                                                         "gradient, as DeepSpeed does by default; it does not check"),
    "zero_optimization.load_from_fp32_weights": (True, "zerodp restores the master weights from the checkpoint's "
                                                       "fp32 values"),
    "zero_optimization.legacy_stage1": (False, "DeepSpeed removed the legacy stage-1 implementation and raises on true"),
    "aio.use_gds": (False, "GPUDirect Storage needs DeepSpeed's CUDA I/O op"),
    "checkpoint.writer": (None, "zerodp writes its own checkpoint format"),
    "checkpoint.parallel_write.pipeline_stage": (False, _PIPE),
    "data_types.param_dtype": (None, "the working dtype comes from the bf16 / fp16 sections"),
    "data_types.buffer_dtype": (None, "buffers keep the dtype they were built with (DeepSpeed's default)"),
    "data_types.keep_in_fp32_modules": (("auto", None), "no module is kept in fp32: every parameter trains in the "
                                                        "working dtype"),
    "seq_parallel_comm_data_type": ("fp32", "the sequence-parallel all-to-alls send activations in their own dtype"),
    "use_data_before_expert_parallelism": (False, "no expert parallelism"),
    "weight_quantization": (None, "weight quantization is an inference feature"),
    "gradient_allreduce_op": ("mean", _REDUCE),
    "prescale_gradients": (False, _REDUCE),
    "gradient_predivide_factor": (1.0, _REDUCE),
    "communication_data_type": (None, _REDUCE),
    "disable_python_gc": (False, "not implemented; call gc.disable() in your script if you want it"),
    "fp16.fp16_master_weights_and_grads": (False, "fp16 master weights are not implemented; "
                                                  "bf16.bf16_master_weights_and_grads is"),
}

NOT_IMPLEMENTED_AT_STAGE_3: dict[str, tuple[Any, str]] = {
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (False, "parameters are fetched with all-gather"),
}

SWITCHED_SECTIONS: dict[str, tuple[str, str]] = {
    # section: (its switch, why the switch cannot be on); the section's other keys act only when it is
    "autotuning": ("enabled", "autotuning drives DeepSpeed's experiment launcher"),
    "tensorboard": ("enabled", _MONITOR), "wandb": ("enabled", _MONITOR),
    "csv_monitor": ("enabled", _MONITOR), "comet": ("enabled", _MONITOR),
    "hybrid_engine": ("enabled", "the RLHF hybrid engine swaps in DeepSpeed's inference kernels"),
    "data_efficiency": ("enabled", "curriculum learning and data routing belong in the data loader"),
    "compile": ("deepcompile", "DeepCompile is DeepSpeed's compiler pass; zerodp compiles the module with "
                               "torch.compile: engine.compile(), or the section's \"disable\": false"),
    "expert_parallel": ("enabled", "zerodp is data-parallel only: no expert parallelism"),
    "datastates": ("enabled", "the DataStates checkpoint engine is not built in"),
    "comms_logger": ("enabled", "the comms logger is not built in; engine.comm_report() gives every collective "
                                "of the last step (op, dtype, calls, bytes)"),
}

NO_EFFECT: dict[str, tuple[Any, str]] = {
    # path: (DeepSpeed's default, or a tuple of it and the values that describe what zerodp does, what
    # zerodp does instead); warned about when set to another value
    # A reuse distance of 0 is what zerodp does at any value; DeepSpeed's default 1e9 is in every stock
    # config. Accepted, not refused: the distance trades memory for communication and changes no number.
    "zero_optimization.stage3_max_reuse_distance": ((1_000_000_000, 0), "stage 3 releases a unit after each use, "
                                                    "as DeepSpeed does at distance 0: a unit used again later in "
                                                    "the step is gathered again"),
    "zero_optimization.contiguous_gradients": (True, "gradients always live in flat buffers"),
    "zero_optimization.overlap_comm": (True, "stage 2 and 3 always reduce gradient buckets while backward goes on "
                                             "(two in flight); stage 1 reduces once, at the boundary"),
    "zero_optimization.allgather_partitions": (True, "stages 1 and 2 always all-gather the updated shards"),
    "zero_optimization.allgather_bucket_size": (500_000_000, "stages 1 and 2 all-gather in place into the flat "
                                                             "parameter buffer: there is no gather buffer to bound"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (True, "stage 2 reduces each bucket piece to the rank that "
                                                                "owns it"),
    "zero_optimization.round_robin_gradients": (False, "gradient pieces are copied to the host in flat order"),
    "zero_optimization.parameter_alignment": (False, "flat buffers are padded only to a multiple of the world size"),
    "zero_optimization.elastic_checkpoint": (False, "every zerodp checkpoint loads at any world size and stage"),
    "zero_optimization.memory_efficient_linear": (True, "stage 3 gathers parameters per unit; nn.Linear is not "
                                                        "replaced"),
    "zero_optimization.override_module_apply": (True, "zero.Init does not patch Module.apply; wrap the call in "
                                                      "zerodp.zero.GatheredParameters to see full weights"),
    "zero_optimization.pipeline_loading_checkpoint": (False, _PIPE),
    "zero_optimization.log_trace_cache_warnings": (False, "stage 3 says when the unit order changes, always"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (False, "with NVMe offload every optimizer state of a "
                                                                     "chunk is swapped together (DeepSpeed's Muon "
                                                                     "is not built in)"),
    "zero_optimization.offload_optimizer.pipeline_read": (False, "NVMe reads always overlap the step"),
    "zero_optimization.offload_optimizer.pipeline_write": (False, "NVMe writes always overlap the step"),
    "zero_optimization.offload_optimizer.fast_init": (False, "swap files are written chunk by chunk at set-up"),
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": (True, _SUPER),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (0.8, _SUPER + " (set OMP_NUM_THREADS instead)"),
    "flops_profiler.recompute_fwd_factor": (0.0, "the flops profiler counts the backward's FLOPs, activation "
                                                 "checkpointing's recomputation included, instead of estimating them"),
    "aio.single_submit": (False, "zerodp's NVMe I/O runs on thread pools, not libaio submissions"),
    "aio.overlap_events": (True, "zerodp's NVMe I/O runs on thread pools, not libaio submissions"),
    "bf16.immediate_grad_update": (False, "gradients accumulate in data_types.grad_accum_dtype and the step "
                                          "reads them once"),
    "checkpoint.load_universal": (False, "every zerodp checkpoint loads at any world size and stage; DeepSpeed's "
                                         "universal checkpoints are not read"),
    "checkpoint.checkpoint_serialization": (True, "checkpoint files are always torch.save zip archives"),
    "optimizer.legacy_fusion": (False, "zerodp builds torch's optimizers, fused where the device allows"),
    "timers.throughput.enabled": (True, "the engine times every step (engine.last_metrics)"),
    "timers.throughput.synchronized": (True, "the engine times every step (engine.last_metrics)"),
    "disable_allgather": (False, "stages 1 and 2 all-gather (on gloo, as one broadcast per rank)"),
    "zero_force_ds_cpu_optimizer": (True, "zerodp steps any torch optimizer under offload (it warns when an Adam is "
                                          "not fused)"),
    "vocabulary_size": (None, "zerodp does not read the vocabulary size (a multiple of 8 helps tensor cores)"),
}


READ_BY_LOAD_CONFIG: dict[str, str] = {
    # path: what it does; keys that act while the config is loaded, so the engine never reads them
    "zerodp.strict_keys": "every unknown key is an error (zerodp/config/unknown.py)",
}


def value_at(cfg: ZeroDPConfig, path: str) -> tuple[Any, bool]:
    """(the value at dotted `path`, whether the user set it); (None, False) below an absent section."""
    node: Any = cfg
    given = True
    for part in path.split("."):
        if node is None:
            return None, False
        if isinstance(node, dict):
            given = given and part in node
            node = node.get(part)
        else:
            given = given and part in node.model_fields_set
            node = getattr(node, part)
    return node, given


def _accepted(value: Any, accepted: Any) -> bool:
    return value in accepted if isinstance(accepted, tuple) else value == accepted


def not_implemented_problems(cfg: ZeroDPConfig) -> list[str]:
    """A problem for every key at a value zerodp does not implement."""
    tables = [NOT_IMPLEMENTED, NOT_IMPLEMENTED_AT_STAGE_3 if cfg.zero_optimization.stage == 3 else {}]
    found = [(path, value, accepted, why) for table in tables for path, (accepted, why) in table.items()
             if not _accepted(value := value_at(cfg, path)[0], accepted) and value_at(cfg, path)[1]]
    for section, (switch, why) in SWITCHED_SECTIONS.items():
        value, _ = value_at(cfg, f"{section}.{switch}")
        if value not in (False, None):
            found.append((f"{section}.{switch}", value, False, why))
    tp_size = (cfg.tensor_parallel or {}).get("autotp_size", 0)
    if tp_size not in (0, 1):
        found.append(("tensor_parallel.autotp_size", tp_size, 1, "zerodp is data-parallel only: no tensor parallelism"))
    for key, value in (cfg.pipeline or {}).items():
        default = PIPELINE_DEFAULTS.get(key, "(no such pipeline key)")
        if value != default:
            found.append((f"pipeline.{key}", value, default, _PIPE))
    return [f"{path}: {show_value(value)} is not supported by zerodp ({why}); remove it or set "
            f"{show_value(accepted[0] if isinstance(accepted, tuple) else accepted)}"
            for path, value, accepted, why in found]


def warn_keys_without_effect(cfg: ZeroDPConfig) -> None:
    """Warn (once, rank 0) about every key the user set, away from DeepSpeed's default, that
    changes nothing in zerodp."""
    for path, (default, instead) in NO_EFFECT.items():
        value, given = value_at(cfg, path)
        if given and not _accepted(value, default):
            warn_once(f"{path}: {show_value(value)} has no effect in zerodp ({instead})")
