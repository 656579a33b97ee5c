"""The library logger and rank-aware helpers.

zerodp never configures the root logger. `zerodp.cli` attaches a handler to the "zerodp" logger
when it runs as a program; `initialize` attaches the same one when the user's script configured
no logging at all (`show_on_stderr`), so the lines a config asks for (steps_per_print,
wall_clock_breakdown, memory_breakdown, dump_state) are seen. Library code logs through `logger`,
`log_rank0` and `warn_once`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("zerodp")


class StderrHandler(logging.StreamHandler):
    """Writes "[zerodp] message" to whatever sys.stderr is when a record is emitted (it may be
    swapped after set-up, as pytest's capture does)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[zerodp] %(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def show_on_stderr(level: str | int | None = None) -> None:
    """Make zerodp's INFO lines visible: attach a StderrHandler unless the zerodp logger or the
    root logger already has a handler (the user configured logging: theirs decides). `level` (the
    config's log_level, or $ZERODP_LOG_LEVEL) sets the zerodp logger's level; default INFO when unset."""
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(StderrHandler())
    level = level or os.environ.get("ZERODP_LOG_LEVEL")
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)

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
