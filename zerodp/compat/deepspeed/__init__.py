"""DeepSpeed's `deepspeed` package over zerodp: what `import deepspeed` is with ZERODP_AS_DEEPSPEED=1.

    ZERODP_AS_DEEPSPEED=1 python train.py       # or: zerodp run / zerodp deepspeed train.py

Each module here mirrors the DeepSpeed module of the same path and forwards to zerodp's own modules
(`deepspeed.initialize` is `zerodp.initialize`, `deepspeed.zero.Init` is `zerodp.zero.Init`, ...;
the one difference: engines built through `deepspeed.initialize` count saved activations only with
`memory_breakdown`, see zerodp.checkpointing's [Note: counting saved activations]).
A name DeepSpeed has and this package does not raises an error naming the DeepSpeed path
(_zerodp_as_deepspeed.NotProvidedByZerodp / AttributeNotProvided); docs/deepspeed.md lists the surface.
`import zerodp as deepspeed` keeps working without the switch.
"""

import functools

from _zerodp_as_deepspeed import DEEPSPEED_API_VERSION, version

import zerodp
from zerodp.compat.deepspeed import (accelerator, checkpoint, comm, compression, git_version_info, launcher, moe,
                                     ops, pipe, runtime, utils)
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.accelerator import get_accelerator
from zerodp.compat.deepspeed.comm import init_distributed
from zerodp.compat.deepspeed.runtime import zero
from zerodp.compat.deepspeed.runtime.activation_checkpointing import checkpointing
from zerodp.compat.deepspeed.runtime.engine import DeepSpeedEngine
from zerodp.compat.deepspeed.runtime.zero import parameter_offload
from zerodp.compat.deepspeed.utils import OnDevice
from zerodp.config import ConfigError as DeepSpeedConfigError
from zerodp.config import add_config_arguments
from zerodp.log import logger


@functools.wraps(zerodp.initialize)
def initialize(*args, **kwargs) -> tuple:
    engine, *rest = zerodp.initialize(*args, **kwargs)
    engine.count_activations = engine.config.memory_breakdown  # DeepSpeed's autograd, unless asked
    parameter_offload.attach(engine)
    runtime.engine.attach(engine)
    return (engine, *rest)


__version__ = version()
__git_hash__ = git_version_info.git_hash
__git_branch__ = git_version_info.git_branch
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_API_VERSION.split("."))

__all__ = ["DeepSpeedConfigError", "DeepSpeedEngine", "OnDevice", "__git_branch__", "__git_hash__", "__version__",
           "accelerator", "add_config_arguments", "checkpoint", "checkpointing", "comm", "compression", "get_accelerator",
           "git_version_info", "init_distributed", "initialize", "launcher", "logger", "moe", "ops", "pipe", "runtime",
           "utils", "zero"]
__getattr__ = missing_attributes(__name__)
