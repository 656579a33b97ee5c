"""DeepSpeed-compatible config: read, walk against the schema, validate, resolve the batch sizes.

    cfg = load_config("ds_config.json", world_size=8)      # or a dict, a JSON string, args=...
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.precision

The bottom layer of zerodp: nothing here imports a zerodp module outside this package except
zerodp.log. One module per concern:

    errors.py      ConfigError, and the report that collects problems before it is raised
    read.py        the input (dict / path / JSON string / args), the world size ($WORLD_SIZE), zero.Init's reads
    clean.py       the raw dict against the schema: removed keys, "auto", deprecated names, unknown keys
    unknown.py     unknown keys: typos are errors, keys DeepSpeed ignores are warned about, strict keys
    section.py     Section, the strict base of every section, and the value types (Int, DType, Device)
    schema.py      the pydantic models and DeepSpeed 0.19.8's defaults
    rules.py       cross-field rules and the message helpers every check shares
    keys.py        keys zerodp does not implement, or that change nothing here
    batch.py       the batch math (train = micro x accumulation x world)
    hparams.py     optimizer.params and scheduler.params
    schedulers.py  DeepSpeed's five schedulers' parameters and the checks on their values
    load.py        load_config: the order of the checks, every problem raised at once
    hf_auto.py     "auto" filled as the Hugging Face Trainer fills it (for `zerodp config check`)
"""

from zerodp.config.batch import BatchMath, batch_problems, consistent_choices
from zerodp.config.errors import ConfigError
from zerodp.config.load import load_config, resolve_batch
from zerodp.config.read import add_config_arguments, param_offload_of, precision_of
from zerodp.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    TimersConfig,
    TorchAutocastConfig,
    ZeroConfig,
    ZeroDPConfig,
)

__all__ = [
    "ActivationCheckpointingConfig", "AioConfig", "BF16Config", "BatchMath", "CheckpointConfig",
    "CommsLoggerConfig", "ConfigError", "DataTypesConfig", "FP16Config", "FlopsProfilerConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig",
    "TimersConfig", "TorchAutocastConfig", "ZeroConfig", "ZeroDPConfig", "add_config_arguments",
    "batch_problems", "consistent_choices", "load_config", "resolve_batch",
]
