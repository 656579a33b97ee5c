"""What every `zerodp` command shares: its exit codes, the parse of a whole-number flag, and the QLoRA
flags `estimate` and `plan` both take."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerodp.plan.quantized import QLoRA

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


def qlora_from_flags(args: argparse.Namespace) -> QLoRA:
    """The QLoRA of `--lora-rank` (default 8), `--lora-targets` and `--double-quant`, as `zerodp estimate`
    and `zerodp plan` read them; ValueError naming the flag for a rank that is not a positive count."""
    from zerodp.plan.quantized import QLoRA
    from zerodp.sizes import parse_count

    rank = parse_count(args.lora_rank) if args.lora_rank is not None else 8
    if rank is None:
        raise ValueError(f"--lora-rank {args.lora_rank}: expected a positive adapter rank such as 8 or 64")
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) or ("all-linear",)
    return QLoRA(rank, targets, args.double_quant)
