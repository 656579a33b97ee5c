"""What every `zerodp` command shares: its exit codes and the parse of a whole-number flag."""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def positive_int(text: str) -> int:
    """argparse's `type` for a whole number >= 1 (ArgumentTypeError naming the text otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value
