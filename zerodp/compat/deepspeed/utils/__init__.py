"""`deepspeed.utils`: the logger, `log_dist`, the z3 leaf-module helpers and zero_to_fp32."""

from __future__ import annotations

import logging

from zerodp import comm
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.utils import module_utils, zero_to_fp32
from zerodp.log import logger
from zerodp.zero import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                         set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` with zerodp's logger on the ranks in `ranks` (DeepSpeed: None or [-1] = every rank)."""
    if ranks is None or -1 in ranks or comm.get_rank() in ranks:
        logger.log(level, "[Rank %d] %s", comm.get_rank(), message)


__all__ = ["get_z3_leaf_modules", "log_dist", "logger", "module_utils", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module",
           "zero_to_fp32"]
__getattr__ = missing_attributes(__name__)
