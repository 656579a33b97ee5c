"""DeepSpeed's JSON config as pydantic models, with DeepSpeed 0.19.8's defaults.

Field names are DeepSpeed's JSON keys, so `ZeroDPConfig.model_validate(ds_config)` reads a
DeepSpeed config unchanged. Use `zerodp.config.load_config`, not these classes directly: it also
rejects unknown, removed and unresolved ("auto") keys with their dotted paths, maps deprecated
keys, checks cross-field rules and resolves the batch sizes against the data-parallel world size.

[Note: which defaults]
DeepSpeed's documentation (docs/_pages/config-json.md) and its code disagree on several defaults.
zerodp takes the code's value of DeepSpeed 0.19.8 everywhere, because that is what a DeepSpeed user
actually got; each disagreement is marked `[docs vs code]` where the field is defined. Defaults
that changed in recent releases (gradient_clipping, bf16.check_grad_overflow, offload pin_memory,
steps_per_print, aio.intra_op_parallelism, managed_gradient_accumulation) are marked `[changed]`.

[Note: strict types]
Every section is strict: a number is not accepted as a bool, "8" is not accepted as 8 (a Hugging
Face integration pitfall, LlamaFactory #1116), and a bool is not accepted as a number. Integer keys
accept a float with no fractional part (`5e8`), because DeepSpeed's own docs write sizes that way.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr

from zerodp.log import warn_once

# ---------------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------------


def _whole_float_to_int(value: Any) -> Any:
    """5e8 -> 500000000; anything else is left for the strict int check to accept or reject."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _lower(value: Any) -> Any:
    """DeepSpeed lower-cases these names before comparing them; so do we."""
    return value.lower() if isinstance(value, str) else value


_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def _canonical_dtype(value: Any) -> Any:
    """Accept DeepSpeed's dtype spellings ("float32", "torch.bfloat16", ...) as fp32/fp16/bf16."""
    if isinstance(value, str):
        return _DTYPE_NAMES.get(value.lower(), value)
    return value


def _even(value: int) -> int:
    if value % 2:
        raise ValueError("must be even (DeepSpeed's stage 1/2 all-gather splits it in halves)")
    return value


def _auto_or_names(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ValueError('expected "auto", null, or a list of module names')


Int = Annotated[int, BeforeValidator(_whole_float_to_int)]
DType = Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(_canonical_dtype)]
Device = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_lower)]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, types are strict.

    `renamed_keys` maps an old key name to its current name (applied, with a warning, by
    `load_config` before validation); `removed_keys` maps a key DeepSpeed removed to
    (the feature it configured, what to do).
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    renamed_keys: ClassVar[dict[str, str]] = {}
    removed_keys: ClassVar[dict[str, tuple[str, str]]] = {}


def _short_name(field: str) -> Any:
    """A read-only property exposing `field` under DeepSpeed's short attribute name."""
    return property(lambda self: getattr(self, field), doc=f"DeepSpeed's attribute name for `{field}`.")


def _alias(name: str, short: str) -> AliasChoices:
    """Accept both DeepSpeed spellings of a key (e.g. stage3_prefetch_bucket_size / prefetch_bucket_size)."""
    return AliasChoices(name, short)


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


class FP16Config(Section):
    """`fp16`: fp16 params and grads with an fp32 master copy and a loss scaler."""

    enabled: bool = False
    auto_cast: bool = False
    # 0 = dynamic scaling; > 0 = a static scale. Finite and >= 0; a bool is rejected (strict).
    loss_scale: float = Field(0.0, ge=0, allow_inf_nan=False)
    initial_scale_power: Int = Field(16, ge=0)  # first dynamic scale = 2**16 = 65536
    loss_scale_window: Int = 1000  # must be > 0 when dynamic: checked by load_config (#8050)
    hysteresis: Int = Field(2, ge=1)  # overflows tolerated before the scale drops ("delayed_shift")
    consecutive_hysteresis: bool = False
    # DeepSpeed types this as int; a float is accepted here. Must be > 0 when dynamic (load_config).
    min_loss_scale: float = Field(1.0, allow_inf_nan=False)
    fp16_master_weights_and_grads: bool = False


class BF16Config(Section):
    """`bf16` (old name `bfloat16`): bf16 params and grads with an fp32 master copy, no scaler."""

    enabled: bool = False
    # [docs vs code] constants.py still says True, but that constant is unused: the pydantic
    # model's False is what DeepSpeed 0.19.8 does.
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True  # [changed] off before v0.19.3 (#8035)
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False  # requires bf16_master_weights_and_grads


class TorchAutocastConfig(Section):
    """`torch_autocast`: run the forward under torch.autocast."""

    enabled: bool = False
    dtype: DType = None
    lower_precision_safe_modules: Optional[list[str]] = None


class DataTypesConfig(Section):
    """`data_types`: dtypes that are not implied by the precision section."""

    # None = the model's dtype, so bf16 training accumulates gradients in bf16 unless "fp32" is set.
    grad_accum_dtype: DType = None
    param_dtype: DType = None
    buffer_dtype: DType = None  # None keeps buffers at their loaded dtype
    # "auto" here is a real DeepSpeed value, not a Hugging Face placeholder.
    keep_in_fp32_modules: Annotated[Any, AfterValidator(_auto_or_names)] = "auto"


# ---------------------------------------------------------------------------------------------
# Optimizer and scheduler
# ---------------------------------------------------------------------------------------------


class OptimizerConfig(Section):
    """`optimizer`: `type` (case-insensitive) and the constructor keyword arguments `params`."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False


class SchedulerConfig(Section):
    """`scheduler`: a DeepSpeed or torch.optim.lr_scheduler class name and its `params`."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# ZeRO
# ---------------------------------------------------------------------------------------------


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: where stage-3 parameter shards live."""

    device: Device = "none"  # [docs vs code] the docs show "cpu"
    nvme_path: Optional[str] = None  # [docs vs code] the docs show "/local_nvme"
    buffer_count: Int = Field(5, ge=0)
    buffer_size: Int = Field(100_000_000, ge=0)
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True  # [changed] False before v0.19.5 (#8207)


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: where the fp32 master and optimizer state live."""

    device: Device = "none"  # [docs vs code] the docs show "cpu"
    nvme_path: Optional[str] = None  # [docs vs code] the docs show "/local_nvme"
    buffer_count: Int = Field(4, ge=0)  # at least the states per param (Adam: 4)
    pin_memory: bool = True  # [changed] False before v0.19.5 (#8207)
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    # Fraction offloaded ("Twin-Flow"). DeepSpeed allows 0; zerodp asks for (0, 1]: offloading
    # nothing is spelled by removing offload_optimizer. < 1 needs stage 3 (load_config checks).
    ratio: float = Field(1.0, gt=0, le=1)
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: float = Field(0.8, ge=0, le=1)


class LeafModuleConfig(Section):
    """`zero_optimization.leaf_module`: modules stage 3 gathers as one unit (no inner hooks)."""

    classes: list[str] = Field(default_factory=list)
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)


class ZeroConfig(Section):
    """`zero_optimization`: the ZeRO stage, buckets, stage-3 fetch policy and offload.

    Stage-3 keys are stored under their `stage3_` names (the spelling in DeepSpeed's docs) and
    also accepted, and readable as attributes, under DeepSpeed's short names
    (`prefetch_bucket_size`, `param_persistence_threshold`, ...).
    """

    renamed_keys: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    removed_keys: ClassVar[dict[str, tuple[str, str]]] = {
        "mics_shard_size": ("MiCS", "delete the key; zerodp shards over the whole data-parallel group"),
        "mics_hierarchical_params_gather": ("MiCS", "delete the key"),
        "zeropp_loco_param": ("LoCo-ZeRO++", "delete the key"),
    }

    stage: Int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Int = Field(500_000_000, gt=0)  # elements, not bytes
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    # DeepSpeed asserts evenness only at stages 1/2; zerodp checks it at every stage.
    allgather_bucket_size: Annotated[Int, AfterValidator(_even)] = Field(500_000_000, gt=0)
    # [docs vs code] the docs say false; the code's None becomes True at stage 3, else False.
    overlap_comm: Optional[bool] = None
    compute_grad_norm: bool = True  # False only at stages 1/2 (load_config checks)
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParamConfig] = None
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    sub_group_size: Int = Field(1_000_000_000, gt=0)  # [docs vs code] the docs example shows 1e12
    # [docs vs code] the docs say 5e8; the code has been 5e7 since at least v0.10.
    stage3_prefetch_bucket_size: Int = Field(
        50_000_000, ge=0, validation_alias=_alias("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    # [docs vs code] the docs JSON example shows 1e6.
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0,
        validation_alias=_alias("stage3_param_persistence_threshold", "param_persistence_threshold"))
    stage3_model_persistence_threshold: Int = Field(
        sys.maxsize, ge=0,
        validation_alias=_alias("stage3_model_persistence_threshold", "model_persistence_threshold"))
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, ge=0, validation_alias=_alias("stage3_max_live_parameters", "max_live_parameters"))
    stage3_max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, validation_alias=_alias("stage3_max_reuse_distance", "max_reuse_distance"))
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, validation_alias=_alias("stage3_gather_16bit_weights_on_model_save",
                                       "gather_16bit_weights_on_model_save"))
    stage3_module_granularity_threshold: Int = Field(
        0, ge=0,
        validation_alias=_alias("stage3_module_granularity_threshold", "module_granularity_threshold"))
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        False, validation_alias=_alias("stage3_use_all_reduce_for_fetch_params",
                                       "use_all_reduce_for_fetch_params"))
    stage3_allgather_sequential: bool = Field(
        False, validation_alias=_alias("stage3_allgather_sequential", "allgather_sequential"))
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False  # DeepSpeed raises if true; so does load_config
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    # ZeRO++ (hpZ, qwZ, qgZ): accepted at these defaults only (see zerodp.config).
    zero_hpz_partition_size: Int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    pipeline_loading_checkpoint: bool = False
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: Optional[dict[str, Any]] = None  # ZenFlow: accepted only when absent

    # DeepSpeed's own attribute names for the stage-3 keys (read-only views).
    prefetch_bucket_size = _short_name("stage3_prefetch_bucket_size")
    param_persistence_threshold = _short_name("stage3_param_persistence_threshold")
    model_persistence_threshold = _short_name("stage3_model_persistence_threshold")
    max_live_parameters = _short_name("stage3_max_live_parameters")
    max_reuse_distance = _short_name("stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save = _short_name("stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold = _short_name("stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params = _short_name("stage3_use_all_reduce_for_fetch_params")
    allgather_sequential = _short_name("stage3_allgather_sequential")

    def model_post_init(self, context: Any, /) -> None:
        """Resolve `overlap_comm`'s stage-dependent default (True at stage 3, else False)."""
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == 3


# ---------------------------------------------------------------------------------------------
# Other sections
# ---------------------------------------------------------------------------------------------


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: options of zerodp.checkpointing.checkpoint."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[Int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class AioConfig(Section):
    """`aio`: the NVMe swap I/O settings (block size, queue depth, threads)."""

    renamed_keys: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}  # [changed] v0.16.4

    block_size: Int = Field(1_048_576, gt=0)
    queue_depth: Int = Field(8, gt=0)
    intra_op_parallelism: Int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False  # GPUDirect Storage: accepted only at false (see zerodp.config)


class ParallelWriteConfig(Section):
    """`checkpoint.parallel_write`."""

    pipeline_stage: bool = False  # pipeline parallelism: accepted only at false


class CheckpointConfig(Section):
    """`checkpoint`: tag validation and load options."""

    tag_validation: Annotated[Literal["Warn", "Ignore", "Fail"],
                              BeforeValidator(lambda v: v.capitalize() if isinstance(v, str) else v)] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: Optional[dict[str, Any]] = None  # DeepSpeed's fast writer: accepted only when absent


class CommsLoggerConfig(Section):
    """`comms_logger`: per-collective logging (zerodp's engine.comm_report() always counts)."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(Section):
    """`flops_profiler`: profile one step on rank 0."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0)
    profile_step: Int = Field(1, ge=1)
    module_depth: Int = Field(-1, ge=-1)  # -1 = every depth
    top_modules: Int = Field(1, ge=1)  # [docs vs code] the format string says 3
    detailed: bool = True
    output_file: Optional[str] = None


class ThroughputTimerConfig(Section):
    """`timers.throughput`: the samples/s timer."""

    enabled: bool = True
    synchronized: bool = True  # device-synchronised timing


class TimersConfig(Section):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


# DeepSpeed's pipeline defaults (runtime/config.py); any other value needs pipeline parallelism.
PIPELINE_DEFAULTS: dict[str, Any] = {
    "stages": "auto", "partition": "best", "seed_layers": False,
    "activation_checkpoint_interval": 0, "pipe_partitioned": True, "grad_partitioned": True,
}

_REMOVED_TOP_LEVEL: dict[str, tuple[str, str]] = {  # key: (feature, what to do)
    "amp": ("Apex AMP", 'use "bf16": {"enabled": true} or "fp16": {"enabled": true} instead'),
    "nebula": ("the Nebula checkpoint service", "delete the section"),
    "compression_training": ("the compression library",
                             "delete the section; compress the trained model with a separate tool"),
    "quantize_training": ("MoQ quantized training", "delete the section"),
    "sparse_gradients": ("CSR sparse gradients", "delete the key; gradients are reduced dense"),
    "eigenvalue": ("eigenvalue estimation, used only by MoQ", "delete the section"),
    "sparse_attention": ("the sparse attention kernels",
                         "delete the section and use an attention implementation in the model"),
    "elasticity": ("elastic training", "delete the section and set the batch keys directly"),
    "graph_harvesting": ("CUDA graph harvesting", "delete the key"),
    "curriculum_learning": ("top-level curriculum learning",
                            "delete the section and schedule the curriculum in your data loader"),
    "progressive_layer_drop": ("progressive layer drop", "delete the section"),
}


class ZeroDPConfig(Section):
    """A DeepSpeed config, validated. Build it with `zerodp.config.load_config`.

    After load_config: `train_batch_size`, `train_micro_batch_size_per_gpu` and
    `gradient_accumulation_steps` are ints (derived as DeepSpeed does), `world_size` is the
    data-parallel size they were resolved against, `batch` is the `BatchMath`, and `precision`
    is "fp32", "bf16" or "fp16".
    """

    renamed_keys: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    removed_keys: ClassVar[dict[str, tuple[str, str]]] = _REMOVED_TOP_LEVEL

    # Batch (reference §2.1): resolved by load_config.
    train_batch_size: Optional[Int] = Field(None, gt=0)
    train_micro_batch_size_per_gpu: Optional[Int] = Field(None, gt=0)
    gradient_accumulation_steps: Optional[Int] = Field(None, gt=0)
    managed_gradient_accumulation: bool = True  # [changed] new in v0.19.4 (#8184)

    # Step behaviour
    gradient_clipping: float = Field(1.0, ge=0, allow_inf_nan=False)  # [changed] 0.0 before v0.19.3 (#8068); 0 disables
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0, allow_inf_nan=False)
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = "mean"
    # None = derive from the precision regime.
    communication_data_type: Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(_lower)] = None
    disable_allgather: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False

    # Logging and diagnostics
    steps_per_print: Optional[Int] = Field(None, gt=0)  # [changed] [docs vs code] docs still say 10
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    disable_python_gc: bool = False
    vocabulary_size: Optional[Int] = Field(None, gt=0)
    log_level: Optional[str] = None

    # Sections
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)

    # DeepSpeed features zerodp does not implement: accepted only at their defaults/absent;
    # load_config reports any other value. The contents of an absent/disabled section are unused.
    pipeline: Optional[dict[str, Any]] = None  # None = PIPELINE_DEFAULTS
    autotuning: Optional[dict[str, Any]] = None
    tensorboard: Optional[dict[str, Any]] = None
    wandb: Optional[dict[str, Any]] = None
    csv_monitor: Optional[dict[str, Any]] = None
    comet: Optional[dict[str, Any]] = None
    hybrid_engine: Optional[dict[str, Any]] = None
    data_efficiency: Optional[dict[str, Any]] = None
    compile: Optional[dict[str, Any]] = None
    tensor_parallel: Optional[dict[str, Any]] = None
    expert_parallel: Optional[dict[str, Any]] = None
    weight_quantization: Optional[dict[str, Any]] = None
    datastates: Optional[dict[str, Any]] = None
    sequence_parallel_size: Int = Field(1, ge=1)
    seq_parallel_comm_data_type: Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_lower)] = "fp32"
    use_data_before_expert_parallelism: bool = False

    # Set by load_config (not config keys).
    _world_size: Optional[int] = PrivateAttr(None)
    _batch: Any = PrivateAttr(None)
    _source: Optional[dict[str, Any]] = PrivateAttr(None)

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch keys were resolved against."""
        if self._world_size is None:
            raise ValueError("this ZeroDPConfig was not resolved: build it with "
                             "zerodp.config.load_config(config, world_size=...)")
        return self._world_size

    @property
    def batch(self) -> Any:
        """The resolved `BatchMath` (train = micro x accumulation x world size)."""
        if self._batch is None:
            raise ValueError("this ZeroDPConfig was not resolved: build it with "
                             "zerodp.config.load_config(config, world_size=...)")
        return self._batch

    @property
    def precision(self) -> str:
        """"bf16" or "fp16" when that section is enabled, else "fp32"."""
        if self.bf16.enabled:
            return "bf16"
        return "fp16" if self.fp16.enabled else "fp32"


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
    if opt is not None and opt.device == "nvme" and zero.stage != 3:
        problems.append(f"{where}.offload_optimizer.device: \"nvme\" needs ZeRO stage 3 "
                        f"({where}.stage is {zero.stage}); use \"cpu\" or stage 3")
    if opt is not None and opt.ratio < 1 and zero.stage != 3:
        problems.append(f"{where}.offload_optimizer.ratio: got {opt.ratio}; partial offload "
                        f"(ratio < 1) needs ZeRO stage 3 ({where}.stage is {zero.stage})")
    for name, section in (("offload_param", param), ("offload_optimizer", opt)):
        if section is not None and section.device == "nvme" and not section.nvme_path:
            problems.append(f'{where}.{name}.nvme_path: required when device is "nvme" '
                            "(a directory on the NVMe drive)")
    return problems


def _zero_rules(cfg: ZeroDPConfig) -> list[str]:
    zero, problems = cfg.zero_optimization, []
    if cfg.gradient_allreduce_op == "sum" and zero.stage == 3:
        problems.append('gradient_allreduce_op: "sum" is not supported with ZeRO stage 3 '
                        '(DeepSpeed rejects it too); use "mean" or stage 0-2')
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


# Optimizers: DeepSpeed's names for torch's optimizers, plus any torch.optim class.
SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")
_ADAM_EXTRA_PARAMS = ["torch_adam", "adam_w_mode", "bias_correction"]  # DeepSpeed's own Adam/AdamW keys
_DEEPSPEED_ONLY_OPTIMIZERS = {
    "lamb": "Lamb", "lion": "Lion", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD",
    "muon": "Muon",
}
DEEPSPEED_SCHEDULER_NAMES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _torch_optimizers() -> dict[str, type]:
    import torch.optim

    return {name.lower(): obj for name, obj in vars(torch.optim).items()
            if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer}


def _torch_schedulers() -> dict[str, type]:
    import torch.optim.lr_scheduler as module

    base = getattr(module, "LRScheduler", getattr(module, "_LRScheduler", object))
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and not name.startswith("_") and name != "LRScheduler"
            and (issubclass(obj, base) or name == "ReduceLROnPlateau")}


def _deepspeed_schedulers() -> dict[str, type] | None:
    """zerodp.lr_schedules.DEEPSPEED_SCHEDULERS, or None while that module does not exist."""
    try:
        from zerodp.lr_schedules import DEEPSPEED_SCHEDULERS
    except ModuleNotFoundError as err:
        if err.name != "zerodp.lr_schedules":
            raise
        return None
    return DEEPSPEED_SCHEDULERS


def _signature_problems(path: str, cls: type, params: dict[str, Any], skip: tuple[str, ...],
                        extra: list[str], owner: str) -> list[str]:
    """Unknown (with did-you-mean) and missing required keyword arguments of `cls`."""
    signature = inspect.signature(cls)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [name for name, p in signature.parameters.items() if name not in skip and p.kind in kinds]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    problems = [f"{path}.{key}: not a parameter of {owner}{hint(key, accepted + extra)}"
                for key in params if key not in accepted + extra and not open_ended]
    problems += [f"{path}.{name}: missing; {owner} requires it"
                 for name in accepted
                 if signature.parameters[name].default is inspect.Parameter.empty and name not in params]
    return problems


def _optimizer_rules(cfg: ZeroDPConfig) -> list[str]:
    if cfg.optimizer is None:
        return []
    name, classes = cfg.optimizer.type, _torch_optimizers()
    cls = classes.get(name.lower())
    if cls is None:
        return [_unknown_optimizer(name, classes)]
    extra = _ADAM_EXTRA_PARAMS if name.lower() in ("adam", "adamw") else []
    params = {k: v for k, v in cfg.optimizer.params.items() if k != "max_grad_norm"}
    problems = _signature_problems("optimizer.params", cls, params, ("params",), extra,
                                   f"torch.optim.{cls.__name__}")
    if extra and params.get("bias_correction", True) is False:
        problems.append("optimizer.params.bias_correction: false is not supported by zerodp (torch's "
                        "Adam and AdamW always correct bias); remove it or set true")
    return problems


def _unknown_optimizer(name: str, classes: dict[str, type]) -> str:
    others = sorted(c.__name__ for c in classes.values() if c.__name__ not in SUPPORTED_OPTIMIZERS)
    supported = (f"supported: {', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive), or any "
                 f"torch.optim class ({', '.join(others)})")
    if name.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
        return (f"optimizer.type: {show_value(name)} is not supported by zerodp (DeepSpeed's "
                f"{_DEEPSPEED_ONLY_OPTIMIZERS[name.lower()]} needs its own CUDA/C++ kernels; zerodp "
                f"builds torch.optim optimizers); {supported}")
    match = did_you_mean(name, [*SUPPORTED_OPTIMIZERS, *others])
    suggestion = f" (did you mean '{match}'?)" if match else ""
    return f"optimizer.type: {show_value(name)} is not an optimizer zerodp knows{suggestion}; {supported}"


def _scheduler_rules(cfg: ZeroDPConfig) -> list[str]:
    if cfg.scheduler is None:
        return []
    name, deepspeed, torch_classes = cfg.scheduler.type, _deepspeed_schedulers(), _torch_schedulers()
    cls = (deepspeed or {}).get(name) or torch_classes.get(name)
    if cls is None and deepspeed is None and name in DEEPSPEED_SCHEDULER_NAMES:
        return []  # zerodp.lr_schedules not there yet: the name is right, params unchecked
    if cls is None:
        names = [*DEEPSPEED_SCHEDULER_NAMES, *sorted(torch_classes)]
        return [f"scheduler.type: {show_value(name)} is neither a DeepSpeed scheduler "
                f"({', '.join(DEEPSPEED_SCHEDULER_NAMES)}) nor a torch.optim.lr_scheduler class"
                f"{hint(name, names)} (names are case-sensitive)"]
    owner = name if deepspeed and name in deepspeed else f"torch.optim.lr_scheduler.{name}"
    return _signature_problems("scheduler.params", cls, cfg.scheduler.params, ("optimizer",), [], owner)


# Each rule with the key paths it reads: a rule is skipped when one of them failed validation.
_RULES: tuple[tuple[tuple[str, ...], Callable[[ZeroDPConfig], list[str]]], ...] = (
    (("fp16.enabled", "bf16.enabled"), _one_precision),
    (("fp16.loss_scale", "fp16.loss_scale_window", "fp16.min_loss_scale"), _dynamic_scale),
    (("fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
      "bf16.bf16_optimizer_states", "zero_optimization.stage", "zero_optimization.offload_optimizer"),
     _master_weight_rules),
    (("zero_optimization.stage", "zero_optimization.offload_param", "zero_optimization.offload_optimizer"),
     _offload_rules),
    (("zero_optimization.stage", "zero_optimization.compute_grad_norm", "gradient_allreduce_op"),
     _zero_rules),
    (("optimizer.params.max_grad_norm", "log_level", "vocabulary_size"), _misc_rules),
    ((), _unsupported_rules),
    (("optimizer.type",), _optimizer_rules),
    (("scheduler",), _scheduler_rules),
)


def semantic_problems(cfg: ZeroDPConfig, usable: Callable[..., bool] = lambda *paths: True) -> list[str]:
    """Problems no single key shows: cross-field rules, features zerodp does not implement,
    optimizer and scheduler names and parameters. `usable(*paths)` says whether those keys
    validated; a rule reading a key that failed is skipped (its default would mislead)."""
    problems: list[str] = []
    for paths, rule in _RULES:
        if usable(*paths):
            problems.extend(rule(cfg))
    return problems
