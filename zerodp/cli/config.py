"""`zerodp config check`: a DeepSpeed config validated and printed resolved, with the batch math."""

from __future__ import annotations

import argparse
import json
import sys

from zerodp.cli.common import EXIT_FAILED, EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp config check`."""
    config = sub.add_parser("config", help="check a DeepSpeed config").add_subparsers(required=True, metavar="ACTION")
    check = config.add_parser("check", help="validate a config and print it resolved, with the batch math")
    check.add_argument("config", help="path to a DeepSpeed JSON config")
    check.add_argument("--world-size", type=int, default=None,
                       help="data-parallel world size (number of processes); default: $WORLD_SIZE")
    check.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    """Print the resolved config and `config OK`, or every problem on stderr (exit 1)."""
    from zerodp.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, world_size=args.world_size)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=2))
    print(f"\nbatch: {cfg.batch.describe()}")
    print(f"precision: {cfg.precision}, ZeRO stage {cfg.zero_optimization.stage}")
    print("config OK")
    return EXIT_OK
