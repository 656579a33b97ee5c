"""`deepspeed.utils`: the logger, `log_dist`, the z3 leaf-module helpers, the tensor-fragment API
(`safe_get_full_fp32_param`, ...: zerodp.zero.fragments), zero_to_fp32, the groups accessors, `OnDevice` and
`RepeatingLoader`."""

from __future__ import annotations

import logging

from zerodp import comm
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.dataloader import RepeatingLoader
from zerodp.compat.deepspeed.utils import groups, module_utils, tensor_fragment, zero_to_fp32
from zerodp.compat.deepspeed.utils.init_on_device import OnDevice
from zerodp.compat.deepspeed.utils.tensor_fragment import *  # noqa: F403 (DeepSpeed exports them here too)
from zerodp.log import logger
from zerodp.zero import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                         set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` with zerodp's logger on the ranks in `ranks` (DeepSpeed: None or [-1] = every rank)."""
    if ranks is None or -1 in ranks or comm.get_rank() in ranks:
        logger.log(level, "[Rank %d] %s", comm.get_rank(), message)


__all__ = ["OnDevice", "RepeatingLoader", "get_z3_leaf_modules", "groups", "log_dist", "logger", "module_utils",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "tensor_fragment",
           "unset_z3_leaf_modules", "z3_leaf_module", "zero_to_fp32", *tensor_fragment.__all__]
__getattr__ = missing_attributes(__name__)
