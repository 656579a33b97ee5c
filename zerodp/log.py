"""The library logger and rank-aware helpers.

zerodp never configures the root logger; `zerodp.cli` attaches a handler to the "zerodp" logger
when it runs as a program. Library code logs through `logger`, `log_rank0` and `warn_once`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("zerodp")

_warned: set[str] = set()


def global_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else $RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log `msg` on global rank 0 only (every rank would print the same line)."""
    if global_rank() == 0:
        logger.log(level, msg, *args)


def warn_once(msg: str) -> None:
    """Log a warning the first time `msg` is seen in this process, on rank 0 only."""
    if msg in _warned:
        return
    _warned.add(msg)
    log_rank0(msg, level=logging.WARNING)
