"""zerodp: a ZeRO (stage 0-3) training engine for PyTorch with DeepSpeed's config and API.

    import zerodp as deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config="ds_config.json")
"""

import importlib.util as _importlib_util
import warnings as _warnings

if _importlib_util.find_spec("numpy") is None:
    # torch warns at import that it cannot use NumPy; zerodp never needs it, so without NumPy
    # installed the warning is noise (a new user's first `zerodp demo` printed it three times).
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from zerodp import checkpoint, checkpointing, comm  # noqa: E402 - after the filter, which must precede torch
from zerodp.api import initialize
from zerodp import sequence  # noqa: E402 - Ulysses sequence parallelism
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
    "checkpoint",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "load_config",
    "sequence",
]
