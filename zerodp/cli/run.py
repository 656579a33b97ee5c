"""`zerodp run` (torchrun's options) and `zerodp deepspeed` (DeepSpeed's launcher flags): zerodp/launcher.py.

Everything after the command word belongs to the launcher and the script, so `zerodp.cli.main`
hands the raw arguments here before argparse sees them; the parser only lists the two commands.
"""

from __future__ import annotations

import argparse
import sys

from zerodp.cli.common import EXIT_OK, EXIT_USAGE


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp run` and `zerodp deepspeed`, for the list of commands (their arguments are not argparse's)."""
    sub.add_parser("run", help="launch a training script on N processes (torchrun's options; see `zerodp run --help`)")
    sub.add_parser("deepspeed", help="launch a DeepSpeed script with DeepSpeed's launcher flags (see `zerodp deepspeed --help`)")


def cmd_run(argv: list[str]) -> int:
    """`zerodp run ARGV`: torchrun with zerodp's defaults; the workers' exit code (2 for a process count
    this machine cannot hold without --allow-oversubscribe)."""
    from zerodp.launcher import OversubscribeError, launch, nproc_alias, split_allow_oversubscribe

    if not argv or argv[0] in ("-h", "--help"):
        print(_run_help())
        return EXIT_OK if argv else EXIT_USAGE
    argv, allow_oversubscribe = split_allow_oversubscribe(nproc_alias(argv))
    try:
        return launch(argv, allow_oversubscribe)
    except OversubscribeError as err:
        print(f"zerodp run: {err}", file=sys.stderr)
        return EXIT_USAGE


def cmd_deepspeed(argv: list[str]) -> int:
    """`zerodp deepspeed ARGV`: DeepSpeed's launcher flags translated for torchrun."""
    from zerodp.launcher import OversubscribeError, launch_deepspeed

    try:
        return launch_deepspeed(argv)
    except OversubscribeError as err:
        print(f"zerodp deepspeed: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as err:  # its messages name the command already
        print(err, file=sys.stderr)
        return EXIT_USAGE


def _run_help() -> str:
    from zerodp import launcher

    return ("usage: zerodp run [--allow-oversubscribe] [--nproc N] [torchrun options] SCRIPT [script args]\n"
            + (launcher.__doc__ or ""))
