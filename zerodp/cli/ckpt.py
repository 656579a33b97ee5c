"""`zerodp ckpt inspect | convert | gather`: read, export and assemble checkpoints (zerodp/checkpoint/)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp ckpt inspect | convert | gather`."""
    ckpt = sub.add_parser("ckpt", help="inspect or convert a zerodp checkpoint (convert: a DeepSpeed one too)").add_subparsers(required=True, metavar="ACTION")
    inspect_ = ckpt.add_parser("inspect", help="what saved a checkpoint and what its files hold, verified "
                                              "(exit 1 naming each damaged file); a DeepSpeed checkpoint too")
    inspect_.add_argument("dir", help="checkpoint directory (with 'latest') or a tag directory")
    inspect_.add_argument("--tag", default=None, help="tag to read (default: the one in DIR/latest)")
    inspect_.add_argument("--deep", action="store_true",
                          help="also recompute every file's sha256 against meta.json (reads every byte; a DeepSpeed "
                               "checkpoint: every zip member's CRC-32); default: sizes and zip directories")
    inspect_.set_defaults(func=cmd_inspect)
    _add_convert(ckpt)
    gather = ckpt.add_parser("gather", help="one checkpoint from the hosts' directories of a save made with "
                                            "checkpoint.use_node_local_storage (copy them onto one machine first)")
    gather.add_argument("dirs", nargs="+", metavar="DIR", help="every host's checkpoint directory (or tag directory)")
    gather.add_argument("--out", required=True, help="directory to write OUT/TAG and OUT/latest into")
    gather.add_argument("--tag", default=None, help="tag to gather (default: the one in each DIR/latest)")
    gather.set_defaults(func=cmd_gather)


def _add_convert(ckpt: argparse._SubParsersAction) -> None:
    convert = ckpt.add_parser("convert", help="write full weights as safetensors or pytorch_model.bin shards, streaming; "
                                              "or a DeepSpeed checkpoint as a zerodp one")
    convert.add_argument("dir", help="checkpoint directory (with 'latest') or a tag directory")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--from", dest="source", choices=["auto", "zerodp", "deepspeed"], default="auto",
                         help="what DIR holds: a zerodp checkpoint, or a DeepSpeed ZeRO checkpoint (stages 1-3: "
                              "global_stepN/*_optim_states.pt); default: whichever it is")
    convert.add_argument("--to", choices=["fp32", "safetensors", "zerodp"], default="safetensors",
                         help="safetensors: model.safetensors, or shards + model.safetensors.index.json (default; "
                              "memory: about the largest tensor); fp32: pytorch_model.bin, or shards + "
                              "pytorch_model.bin.index.json (memory: about one shard); zerodp (--from deepspeed): "
                              "a zerodp checkpoint OUT/TAG with the masters, optimizer state, scheduler and counters")
    convert.add_argument("--tag", default=None, help="tag to read (default: the one in DIR/latest)")
    convert.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                         help="dtype of the trainable weights written (default fp32, the master weights)")
    convert.add_argument("--hf-config", default=None, metavar="DIR",
                         help="Hugging Face model directory to copy config.json and generation_config.json from, "
                              "so that from_pretrained(OUT) works (default: weights only)")
    convert.add_argument("--max-shard-size", default="5GB", type=_byte_size,
                         help="largest output file: 500MB, 5GB or 5G (powers of 1000), 5GiB (powers of 1024); default 5GB")
    convert.set_defaults(func=cmd_convert)


def _byte_size(text: str) -> int:
    """argparse's `type` for --max-shard-size: a usage error (exit 2) for anything parse_size refuses,
    1e400GB included, before any file is read."""
    from zerodp.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--max-shard-size ")) from None


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print what saved the checkpoint and what its files hold; each damaged file on stderr (exit 1)."""
    from zerodp.checkpoint.format import CheckpointError
    from zerodp.checkpoint.verify import inspect_checkpoint

    try:
        found = inspect_checkpoint(args.dir, args.tag, deep=args.deep)
    except (CheckpointError, OSError) as err:
        print(f"zerodp ckpt inspect: {err}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(found.lines))
    for problem in found.damaged:
        print(f"zerodp ckpt inspect: {problem}", file=sys.stderr)
    return EXIT_FAILED if found.damaged else EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    """Write the export `--to` asks for; every file written on stdout. Flags that do not fit what DIR
    holds are refused (exit 2) before any weight is written."""
    from pathlib import Path

    from zerodp.checkpoint.convert import hf_config_problem
    from zerodp.checkpoint.deepspeed import find_tag_dir
    from zerodp.checkpoint.format import CheckpointError
    from zerodp.checkpoint.safe_io import output_inside_input

    try:
        is_deepspeed = Path(args.dir).is_dir() and find_tag_dir(Path(args.dir), args.tag) is not None
    except CheckpointError as err:
        if args.tag is None:  # DIR/latest is damaged: bad data, not a bad argument
            print(f"zerodp ckpt convert: {err}", file=sys.stderr)
            return EXIT_FAILED
        is_deepspeed, problem = False, str(err)
    else:
        problem = _convert_source_problem(args, is_deepspeed)
    problem = output_inside_input(args.out, [args.dir], "OUT") or problem
    problem = problem or (hf_config_problem(args.hf_config) if args.hf_config else None)
    if problem:  # before any weight is written
        print(f"zerodp ckpt convert: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        files = _convert(args)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"zerodp ckpt convert: {err}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(str(f) for f in files))
    return EXIT_OK


def _convert(args: argparse.Namespace) -> list:
    """The conversion itself, with a progress bar on stderr; the files written."""
    import torch

    from zerodp.checkpoint import convert_to_safetensors, convert_to_torch
    from zerodp.checkpoint.convert import copy_hf_config
    from zerodp.checkpoint.deepspeed import convert_to_zerodp

    bar: list = []
    progress = _progress_into(bar)
    if args.to == "zerodp":
        files = convert_to_zerodp(args.dir, args.out, args.tag, progress)
    else:
        convert = convert_to_torch if args.to == "fp32" else convert_to_safetensors
        dtype = getattr(torch, _DTYPES[args.dtype])
        files = convert(args.dir, args.out, args.tag, dtype, args.max_shard_size, progress)
    if args.hf_config:
        files += copy_hf_config(args.hf_config, args.out)
    if bar:
        bar[0].close()
    return files


def _progress_into(bar: list) -> Callable[[int, int], None]:
    """A (done, total) callback that draws a progress bar on stderr, made at the first call, into `bar`."""
    from zerodp.metrics import ProgressBar

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(ProgressBar(total, sys.stderr))
        bar[0].update(done)

    return progress


def cmd_gather(args: argparse.Namespace) -> int:
    """One checkpoint from every host's directory of a node-local save; its path on stdout."""
    from zerodp.checkpoint.format import CheckpointError
    from zerodp.checkpoint.gather import gather_checkpoint
    from zerodp.checkpoint.safe_io import output_inside_input

    problem = output_inside_input(args.out, args.dirs, "--out")
    if problem:  # before anything is written
        print(f"zerodp ckpt gather: {problem}", file=sys.stderr)
        return EXIT_USAGE
    bar: list = []
    try:
        out = gather_checkpoint(args.dirs, args.out, args.tag, _progress_into(bar))
    except (CheckpointError, OSError) as err:
        print(f"zerodp ckpt gather: {err}", file=sys.stderr)
        return EXIT_FAILED
    if bar:
        bar[0].close()
    print(out)
    return EXIT_OK


def _convert_source_problem(args: argparse.Namespace, is_deepspeed: bool) -> str | None:
    """Why `--from` / `--to` do not fit what DIR holds (None when they do)."""
    found = "a DeepSpeed checkpoint" if is_deepspeed else "not a DeepSpeed checkpoint"
    if args.source == "deepspeed" and not is_deepspeed:
        return (f"--from deepspeed: {args.dir} is {found} (expected 'latest' naming a tag directory with "
                "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt)")
    if args.source == "zerodp" and is_deepspeed:
        return f"--from zerodp: {args.dir} is {found}; pass --from deepspeed (or leave --from out)"
    if args.to == "zerodp" and not is_deepspeed:
        return f"--to zerodp converts a DeepSpeed checkpoint, and {args.dir} is {found}"
    return None
