"""`zerodp config check`: a DeepSpeed config validated and printed resolved, with the batch math.

A config with Hugging Face "auto" placeholders (or `--hf`) is first filled as the Hugging Face
Trainer fills it (zerodp/config/hf_auto.py), from `--micro-batch`, `--accumulation`,
`--hidden-size` and `--dtype` (when not given: the value the config itself sets, else transformers'
default; the hidden size defaults to 4096); what was filled is listed,
and the exit code reflects only the problems that remain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, positive_int

_HF_DEFAULTS = {"micro_batch": 8, "accumulation": 1, "hidden_size": 4096, "dtype": "fp32"}
"""transformers' TrainingArguments defaults (per_device_train_batch_size 8, gradient_accumulation_steps 1,
neither --bf16 nor --fp16), and a 7B LLaMA's hidden size for the keys the Trainer derives from the model."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp config check`."""
    config = sub.add_parser("config", help="check a DeepSpeed config").add_subparsers(required=True, metavar="ACTION")
    check = config.add_parser("check", help="validate a config and print it resolved, with the batch math")
    check.add_argument("config", help="path to a DeepSpeed JSON config")
    check.add_argument("--world-size", type=int, default=None,
                       help="data-parallel world size (number of processes); default: $WORLD_SIZE")
    hf = check.add_argument_group("Hugging Face \"auto\" (on by itself when the config holds \"auto\")")
    hf.add_argument("--hf", action="store_true",
                    help="fill \"auto\" as the Hugging Face Trainer does before checking")
    hf.add_argument("--micro-batch", type=positive_int, default=None,
                    help=f"--per_device_train_batch_size of the run (default {_HF_DEFAULTS['micro_batch']})")
    hf.add_argument("--accumulation", type=positive_int, default=None,
                    help=f"--gradient_accumulation_steps of the run (default {_HF_DEFAULTS['accumulation']})")
    hf.add_argument("--hidden-size", type=positive_int, default=None,
                    help=f"the model's hidden_size (default {_HF_DEFAULTS['hidden_size']})")
    hf.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                    help="fp16 = --fp16, bf16 = --bf16 (default fp32: neither)")
    check.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    """Print the resolved config and `config OK`, or every problem on stderr (exit 1)."""
    from zerodp.config import ConfigError, load_config
    from zerodp.config.hf_auto import holds_auto
    from zerodp.config.read import read_input

    try:
        raw, source, _ = read_input(args.config, None)
        if args.hf or holds_auto(raw):
            filled_raw, problems = _fill_auto(raw, args)
            try:
                cfg = load_config(filled_raw, world_size=args.world_size)
            except ConfigError as err:  # name the file, not the filled dict
                raise ConfigError(problems + err.problems, source) from None
            if problems:
                raise ConfigError(problems, source)
        else:
            cfg = load_config(args.config, world_size=args.world_size)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=2))
    print(f"\nbatch: {cfg.batch.describe()}")
    print(f"precision: {cfg.precision}, ZeRO stage {cfg.zero_optimization.stage}")
    print("config OK")
    return EXIT_OK


def _fill_auto(raw: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """`raw` filled as the Trainer fills it, after printing what was filled; and the Trainer's
    refusals of a set value that differs from a flag given on the command line."""
    from zerodp.config import ConfigError
    from zerodp.config.hf_auto import TrainerArgs, fill_hf_auto, trainer_mismatches

    world_size = args.world_size or _env_world_size()
    if world_size is None:
        raise ConfigError('filling "auto" needs the data-parallel world size (the Trainer sets train_batch_size = '
                          "world size x micro-batch x accumulation): give --world-size N")
    given = {name: getattr(args, name) for name in _HF_DEFAULTS if getattr(args, name) is not None}
    defaults = {**_HF_DEFAULTS, **_defaults_from(raw)}
    values = {**defaults, **given}
    trainer = TrainerArgs(world_size=world_size, micro_batch_size=values["micro_batch"],
                          gradient_accumulation_steps=values["accumulation"], hidden_size=values["hidden_size"],
                          dtype=values["dtype"])
    filled_raw, filled = fill_hf_auto(raw, trainer)
    assumed = [f"--{name.replace('_', '-')} {value}" for name, value in defaults.items() if name not in given]
    print(f'filled "auto" as the Hugging Face Trainer would, at world size {world_size}'
          + (f" (assumed: {', '.join(assumed)})" if assumed else "") + ":")
    for note in filled:
        print(f"  {note.describe()}")
    if not filled:
        print("  nothing: no key the Trainer fills holds \"auto\"")
    print()
    return filled_raw, trainer_mismatches(raw, trainer, _checked_paths(given))


def _defaults_from(raw: dict[str, Any]) -> dict[str, Any]:
    """The flags a run must have given when the config sets their key to a value (the Trainer refuses a
    mismatch), so that an unspecified flag does not invent a problem: the micro-batch and
    accumulation it sets, and the precision it enables."""
    found: dict[str, Any] = {}
    for name, key in (("micro_batch", "train_micro_batch_size_per_gpu"),
                      ("accumulation", "gradient_accumulation_steps")):
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[name] = value
    for dtype in ("bf16", "fp16"):
        section = raw.get(dtype)
        if isinstance(section, dict) and section.get("enabled") is True:
            found["dtype"] = dtype
    return found


def _checked_paths(given: dict[str, Any]) -> set[str]:
    """The keys whose set value the Trainer compares with a flag the user gave."""
    paths: set[str] = set()
    if "micro_batch" in given:
        paths |= {"train_micro_batch_size_per_gpu", "train_batch_size"}
    if "accumulation" in given:
        paths |= {"gradient_accumulation_steps", "train_batch_size"}
    if "dtype" in given:
        paths |= {"fp16.enabled", "bf16.enabled"}
    return paths


def _env_world_size() -> int | None:
    env = os.environ.get("WORLD_SIZE", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else None
