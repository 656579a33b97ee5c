"""The `zerodp` command: one module per command, this one the parser and the entry point.

    zerodp demo                                   # train a small GPT on 2 CPU processes
    zerodp config check ds.json --world-size 8    # validate a DeepSpeed config, show the batch math
    zerodp run --nproc-per-node 2 train.py ...    # torchrun with zerodp's defaults
    zerodp deepspeed --num_gpus 2 train.py ...    # DeepSpeed's launcher flags, over torchrun
    zerodp ckpt convert ckpt/ out/                # full weights as safetensors shards
    zerodp ckpt convert ds_ckpt/ out/ --to zerodp # a DeepSpeed ZeRO checkpoint as a zerodp one
    zerodp ckpt gather h0/ckpt h1/ckpt --out ckpt # one checkpoint from a node-local save's host directories
    zerodp estimate --params 7B --world-size 64   # model states per rank for every strategy
    zerodp estimate demo --world-size 2           # ... and the peak of a simulated training step
    zerodp plan demo --gpus-per-node 8 --seq-len 32 --global-batch 256  # the configs that fit, fastest first
    zerodp doctor zerodp_oom/                     # the OOM doctor's reports of a run that ran out of memory
    zerodp compare --out cmp                      # DDP, FSDP2, DeepSpeed and zerodp side by side

Each command is a module here with `add_parser(sub)` and its `cmd_*` functions (run.py holds `run`
and `deepspeed`); printing and exit codes (common.py) live in this package, the work below it.
"""

from __future__ import annotations

import argparse
import os
import sys

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zerodp` console script; returns the process exit code."""
    from zerodp.cli.run import cmd_deepspeed, cmd_run

    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    if argv[:1] == ["run"]:  # everything after `run` belongs to torchrun and the script
        return cmd_run(argv[1:])
    if argv[:1] == ["deepspeed"]:  # everything after `deepspeed` belongs to the launcher and the script
        return cmd_deepspeed(argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


def _setup_logging() -> None:
    from zerodp.log import StderrHandler, logger

    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
    logger.setLevel(os.environ.get("ZERODP_LOG_LEVEL", "INFO"))


def _parser() -> argparse.ArgumentParser:
    """Every command's parser, in the order `zerodp --help` lists them."""
    from zerodp.cli import ckpt, compare, config, demo, doctor, estimate, plan, run

    parser = argparse.ArgumentParser(prog="zerodp", description="ZeRO training engine for PyTorch (DeepSpeed-compatible).")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for command in (run, config, ckpt, estimate, plan, doctor, compare, demo):
        command.add_parser(sub)
    return parser
