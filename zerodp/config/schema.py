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

Every section is strict: [Note: strict types] in zerodp/config/section.py.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, model_validator

from zerodp.config.deprecated import one_name_is_a_list, upgrade_for_model, upgrade_zero_keys
from zerodp.config.section import (DType, Device, Int, Section, alias, auto_or_names, even, infinity_is_never, lower,
                                   short_name)


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

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    enabled: bool = False
    dtype: DType = None
    lower_precision_safe_modules: Optional[list[str]] = None


class DataTypesConfig(Section):
    """`data_types`: dtypes that are not implied by the precision section."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    # None = the model's dtype, so bf16 training accumulates gradients in bf16 unless "fp32" is set.
    grad_accum_dtype: DType = None
    param_dtype: DType = None
    buffer_dtype: DType = None  # None keeps buffers at their loaded dtype
    # "auto" here is a real DeepSpeed value, not a Hugging Face placeholder.
    keep_in_fp32_modules: Annotated[Any, AfterValidator(auto_or_names)] = "auto"


# ---------------------------------------------------------------------------------------------
# Optimizer and scheduler
# ---------------------------------------------------------------------------------------------


class OptimizerConfig(Section):
    """`optimizer`: `type` (case-insensitive) and the constructor keyword arguments `params`."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False


class SchedulerConfig(Section):
    """`scheduler`: a DeepSpeed or torch.optim.lr_scheduler class name and its `params`."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
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
    # nothing is spelled by removing offload_optimizer. < 1 (partial offload) is refused (keys.py).
    ratio: float = Field(1.0, gt=0, le=1)
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: float = Field(0.8, ge=0, le=1)

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's read-only attribute (not a key there either): pipeline_read or pipeline_write."""
        return self.pipeline_read or self.pipeline_write


_Names = Annotated[list[str], BeforeValidator(one_name_is_a_list)]


class LeafModuleConfig(Section):
    """`zero_optimization.leaf_module`: modules stage 3 gathers as one unit (no inner hooks)."""

    classes: _Names = Field(default_factory=list)
    names: _Names = Field(default_factory=list)
    name_suffixes: _Names = Field(default_factory=list)


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
        "zeropp_loco_param": ("LoCo-ZeRO++", "delete the key"),
    }

    stage: Int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Int = Field(500_000_000, gt=0)  # elements, not bytes
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    # DeepSpeed asserts evenness only at stages 1/2; zerodp checks it at every stage.
    allgather_bucket_size: Annotated[Int, AfterValidator(even)] = Field(500_000_000, gt=0)
    # [docs vs code] the docs say false; the code's None becomes True at stage 3, else False.
    overlap_comm: Optional[bool] = None
    compute_grad_norm: bool = True  # False only at stages 1/2 (load_config checks)
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParamConfig] = None
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    # [docs vs code] the docs example shows 1e12. 0 is DeepSpeed's "one sub-group per parameter" (rules.py).
    sub_group_size: Int = Field(1_000_000_000, ge=0)
    # [docs vs code] the docs say 5e8; the code has been 5e7 since at least v0.10.
    stage3_prefetch_bucket_size: Int = Field(
        50_000_000, ge=0, validation_alias=alias("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    # [docs vs code] the docs JSON example shows 1e6.
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0,
        validation_alias=alias("stage3_param_persistence_threshold", "param_persistence_threshold"))
    stage3_model_persistence_threshold: Int = Field(
        sys.maxsize, ge=0,
        validation_alias=alias("stage3_model_persistence_threshold", "model_persistence_threshold"))
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, ge=0, validation_alias=alias("stage3_max_live_parameters", "max_live_parameters"))
    stage3_max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, validation_alias=alias("stage3_max_reuse_distance", "max_reuse_distance"))
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, validation_alias=alias("stage3_gather_16bit_weights_on_model_save",
                                       "gather_16bit_weights_on_model_save"))
    stage3_module_granularity_threshold: Int = Field(
        0, ge=0,
        validation_alias=alias("stage3_module_granularity_threshold", "module_granularity_threshold"))
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        False, validation_alias=alias("stage3_use_all_reduce_for_fetch_params",
                                       "use_all_reduce_for_fetch_params"))
    stage3_allgather_sequential: bool = Field(
        False, validation_alias=alias("stage3_allgather_sequential", "allgather_sequential"))
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False  # DeepSpeed raises if true; so does load_config
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    # hierarchical partitioning at stage 3 (zero/topology.py): ZeRO++ hpZ, and MiCS (which DeepSpeed
    # 0.19 removed; zerodp keeps its meaning). 1 / 0 / -1: off. load_config checks them against the world.
    zero_hpz_partition_size: Int = Field(1, ge=0)
    mics_shard_size: Int = Field(-1, ge=-1)
    mics_hierarchical_params_gather: bool = False
    # ZeRO++ quantized collectives at stage 3 (zero/quantized_comm.py): qwZ and qgZ; storing frozen weights
    # quantized is refused (config/keys.py), the combinations not built are refused by config/rules.py.
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    pipeline_loading_checkpoint: bool = False
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False  # Muon's momentum kept off NVMe (keys.py: no effect)
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: Optional[dict[str, Any]] = None  # ZenFlow: accepted only when absent

    # DeepSpeed's own attribute names for the stage-3 keys (read-only views).
    prefetch_bucket_size = short_name("stage3_prefetch_bucket_size")
    param_persistence_threshold = short_name("stage3_param_persistence_threshold")
    model_persistence_threshold = short_name("stage3_model_persistence_threshold")
    max_live_parameters = short_name("stage3_max_live_parameters")
    max_reuse_distance = short_name("stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save = short_name("stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold = short_name("stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params = short_name("stage3_use_all_reduce_for_fetch_params")
    allgather_sequential = short_name("stage3_allgather_sequential")

    @model_validator(mode="before")
    @classmethod
    def _deprecated_offload_switches(cls, data: Any) -> Any:
        """cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory, when built directly."""
        return upgrade_for_model({}, data, upgrade_zero_keys)

    def model_post_init(self, context: Any, /) -> None:
        """Resolve `overlap_comm`'s stage-dependent default (True at stage 3, else False)."""
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == 3


# ---------------------------------------------------------------------------------------------
# Other sections
# ---------------------------------------------------------------------------------------------


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: options of zerodp.checkpointing.checkpoint."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[Int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class AioConfig(Section):
    """`aio`: the NVMe swap I/O settings (block size, queue depth, threads)."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    renamed_keys: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}  # [changed] v0.16.4

    block_size: Int = Field(1_048_576, gt=0)
    queue_depth: Int = Field(8, gt=0)
    intra_op_parallelism: Int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False  # GPUDirect Storage: accepted only at false (see zerodp.config)


class ParallelWriteConfig(Section):
    """`checkpoint.parallel_write`."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    pipeline_stage: bool = False  # pipeline parallelism: accepted only at false


class CheckpointConfig(Section):
    """`checkpoint`: tag validation, load options, and async saves."""

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
    tag_validation: Annotated[Literal["Warn", "Ignore", "Fail"],
                              BeforeValidator(lambda v: v.capitalize() if isinstance(v, str) else v)] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    async_save: bool = False  # zerodp's: save_checkpoint copies to host memory and writes in the background
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

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
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

    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads it with dict.get
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


class ZeroDPOptionsConfig(Section):
    """`zerodp`: zerodp's own settings (DeepSpeed ignores this top-level key, so a config that has
    it still runs under DeepSpeed). Unknown keys inside it are always errors."""

    own_section: ClassVar[bool] = True  # not DeepSpeed's: messages about its keys must not cite DeepSpeed

    # Every unknown key an error, also where DeepSpeed ignores it ($ZERODP_STRICT_CONFIG=1 does the
    # same); read by load_config before anything else (zerodp/config/unknown.py).
    strict_keys: bool = False


class ZeroDPConfig(Section):
    """A DeepSpeed config, validated. Build it with `zerodp.config.load_config`.

    After load_config: `train_batch_size`, `train_micro_batch_size_per_gpu` and
    `gradient_accumulation_steps` are ints (derived as DeepSpeed does), `world_size` is the
    data-parallel size they were resolved against, `batch` is the `BatchMath`, and `precision`
    is "fp32", "bf16" or "fp16".
    """

    renamed_keys: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    removed_keys: ClassVar[dict[str, tuple[str, str]]] = _REMOVED_TOP_LEVEL
    deepspeed_ignores_unknown: ClassVar[bool] = True  # DeepSpeed reads the top level with dict.get

    # Batch (reference §2.1): resolved by load_config.
    train_batch_size: Optional[Int] = Field(None, gt=0)
    train_micro_batch_size_per_gpu: Optional[Int] = Field(None, gt=0)
    gradient_accumulation_steps: Optional[Int] = Field(None, gt=0)
    managed_gradient_accumulation: bool = True  # [changed] new in v0.19.4 (#8184)

    # Step behaviour
    gradient_clipping: float = Field(1.0, ge=0, allow_inf_nan=False)  # [changed] 0.0 before v0.19.3 (#8068); 0 disables
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0, allow_inf_nan=False)
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(lower)] = "mean"
    # None = derive from the precision regime.
    communication_data_type: Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(lower)] = None
    disable_allgather: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False

    # Logging and diagnostics
    steps_per_print: Annotated[Optional[Int], BeforeValidator(infinity_is_never)] = Field(None, gt=0)  # [changed] [docs vs code] docs still say 10; Infinity = never
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
    zerodp: ZeroDPOptionsConfig = Field(default_factory=ZeroDPOptionsConfig)

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
    sequence_parallel_size: Int = Field(1, ge=1)  # Ulysses: ranks sharing one sequence (zerodp/sequence/)
    seq_parallel_comm_data_type: Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(lower)] = "fp32"
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
    def num_ranks(self) -> int:
        """Every rank: the data-parallel world size x sequence_parallel_size (ZeRO partitions over all)."""
        return self.world_size * self.sequence_parallel_size

    @property
    def batch(self) -> Any:
        """The resolved `BatchMath` (train = micro x accumulation x world size)."""
        if self._batch is None:
            raise ValueError("this ZeroDPConfig was not resolved: build it with "
                             "zerodp.config.load_config(config, world_size=...)")
        return self._batch

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's `engine.config.get(key)` (transformers' Trainer reads
        `engine.config.get("zero_optimization", {}).get("stage")`): the resolved config as JSON, by
        DeepSpeed's key names; sections are dicts."""
        return self.model_dump(mode="json", exclude_none=True).get(key, default)

    def __getitem__(self, key: str) -> Any:
        """`engine.config["zero_optimization"]`: as `get`, KeyError when the key is not set."""
        dumped = self.model_dump(mode="json", exclude_none=True)
        if key not in dumped:
            raise KeyError(key)
        return dumped[key]

    @property
    def precision(self) -> str:
        """"bf16" or "fp16" when that section is enabled, else "fp32"."""
        if self.bf16.enabled:
            return "bf16"
        return "fp16" if self.fp16.enabled else "fp32"
