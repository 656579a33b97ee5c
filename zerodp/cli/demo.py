"""`zerodp demo`: the demo's GPT trained on N local processes through `zerodp run` (zerodp/demo/train.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from zerodp.cli.common import EXIT_USAGE, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp demo`."""
    from zerodp.launcher import OVERSUBSCRIBE_HELP

    demo = sub.add_parser("demo", help="train a small GPT on a synthetic task, then show the memory ledger")
    demo.add_argument("--nproc", type=positive_int, default=2, help="processes (ranks) to launch (default 2)")
    demo.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default: the demo's)")
    demo.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage (default 0)")
    demo.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="precision (default fp32)")
    demo.add_argument("--config", default=None, help="a DeepSpeed JSON config to start from (flags override it)")
    demo.add_argument("--activation-checkpointing", action="store_true",
                      help="checkpoint every transformer block (compare the saved-activation bytes with and without)")
    demo.add_argument("--allow-oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Check the demo's config (one message, exit 2, instead of N tracebacks), then launch it."""
    from zerodp.cli.run import cmd_run
    from zerodp.config import ConfigError, load_config
    from zerodp.demo import train as train_script
    from zerodp.demo.train import demo_config
    from zerodp.launcher import OversubscribeError, check_local_ranks

    try:
        check_local_ranks(f"--nproc {args.nproc}", args.nproc, args.allow_oversubscribe)  # before any world math
        config = demo_config(args.config, stage=args.stage, dtype=args.dtype)
        try:
            load_config(config, world_size=args.nproc)  # fail here, not in N tracebacks
        except ConfigError as err:  # name the file the user gave, not the dict read from it
            raise ConfigError(err.problems, f"'{args.config}'" if args.config else err.source) from None
    except (ConfigError, OSError, OversubscribeError) as err:
        print(f"zerodp demo: {err}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="zerodp-demo-") as tmp:
        path = os.path.join(tmp, "ds_config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        # The script by path, not `-m zerodp.demo.train`: -m puts the working directory first on
        # sys.path, and a directory there named zerodp (a checkout's root) would shadow the package.
        argv = ["--allow-oversubscribe"] if args.allow_oversubscribe else []
        argv += ["--nproc-per-node", str(args.nproc), train_script.__file__, "--config", path]
        if args.steps is not None:
            argv += ["--steps", str(args.steps)]
        if args.activation_checkpointing:
            argv.append("--activation-checkpointing")
        _quiet_demo_children()
        return cmd_run(argv)


def _quiet_demo_children() -> None:
    """A new user should see the demo's own lines: no torchrun banner about OMP_NUM_THREADS (set to
    what torchrun would set), no zerodp INFO lines that repeat the demo's header, no torch warning
    about a NumPy zerodp does not need."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("ZERODP_LOG_LEVEL", "WARNING")
    ignore = "ignore:Failed to initialize NumPy"  # the children import torch before zerodp's own filter
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), ignore]))
