"""zerodp: a ZeRO (stage 0-3) training engine for PyTorch with DeepSpeed's config and API.

    import zerodp as deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config="ds_config.json")
"""

from zerodp import checkpointing, comm
from zerodp.api import initialize
from zerodp.comm import init_distributed
from zerodp.config import ConfigError, ZeroDPConfig, add_config_arguments, load_config
from zerodp.engine import Engine

__version__ = "0.1.0"

DeepSpeedEngine = Engine  # the name DeepSpeed scripts use in isinstance checks

__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "Engine",
    "ZeroDPConfig",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "load_config",
]
