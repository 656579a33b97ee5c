"""DeepSpeed's `zero_to_fp32.py` command line over zerodp's converter (zerodp.checkpoint.convert): what the
script save_checkpoint leaves in every checkpoint folder runs, and `python -m deepspeed.utils.zero_to_fp32`
under ZERODP_AS_DEEPSPEED=1.

    python checkpoints/zero_to_fp32.py checkpoints out/ [--safe_serialization] [-t TAG] [--max_shard_size 2GB]
    python -m zerodp.cli.zero_to_fp32 checkpoints out/          # the same, without the script

The flags and the files written are DeepSpeed 0.19's (pytorch_model*.bin or model*.safetensors, an index
when sharded); it reads zerodp's checkpoints and DeepSpeed's own folders alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from zerodp.checkpoint.convert import convert_to_safetensors, convert_to_torch
from zerodp.log import logger
from zerodp.sizes import parse_size


def refuse_unsupported(function: str, exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    """Refuse what zerodp's consolidation does not do (NotImplementedError naming `function`'s argument)."""
    if exclude_frozen_parameters:
        raise NotImplementedError(f"{function}(exclude_frozen_parameters=True) is not supported by zerodp: a zerodp "
                                  "checkpoint keeps frozen parameters beside buffers; save without them instead "
                                  "(engine.save_checkpoint(dir, exclude_frozen_parameters=True))")
    if lazy_mode:
        raise NotImplementedError(f"{function}(lazy_mode=True) is not supported by zerodp: it returns materialised "
                                  "tensors; `zerodp ckpt convert` streams a large model to disk one tensor at a time")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int | None = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the checkpoint's fp32 weights to `output_dir` as `pytorch_model*.bin` (or, with
    safe_serialization, `model*.safetensors`) shards of at most `max_shard_size` plus an index, as
    DeepSpeed does; returns the files written."""
    refuse_unsupported("convert_zero_checkpoint_to_fp32_state_dict", exclude_frozen_parameters)
    if max_shard_size is None:  # DeepSpeed: one file, unsharded
        max_shard_size = 2**62
    size = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size, "max_shard_size")
    write = convert_to_safetensors if safe_serialization else convert_to_torch
    return write(checkpoint_dir, output_dir, tag, torch.float32, size)


_SINGLE_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
"""An output path with one of these suffixes (and not a directory) is one file, as the `output_file` of
DeepSpeed before 0.14 (`python zero_to_fp32.py . pytorch_model.bin`, still in Hugging Face's docs)."""


def _parser() -> argparse.ArgumentParser:
    """DeepSpeed 0.19's zero_to_fp32.py arguments."""
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py", description=(
        "Consolidate a ZeRO checkpoint (zerodp's, or DeepSpeed's own folders) into fp32 weights: "
        "pytorch_model*.bin, or model*.safetensors with --safe_serialization, plus an index when sharded."))
    parser.add_argument("checkpoint_dir", help="the checkpoint folder holding `latest` and the tag folders, "
                                               "e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="directory for the fp32 state dict files (a path ending in .bin, .pt, "
                                           ".pth or .safetensors: one file, as DeepSpeed's older output_file)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest output file before the weights are split into shards (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors instead of pickled PyTorch files")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag, e.g. global_step1 (default: `latest`)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="log each file written")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [flags]`; returns the exit code
    (1 with the reason on stderr for a checkpoint it cannot read)."""
    parser = _parser()
    args = parser.parse_args(argv)
    output = Path(args.output_dir)
    try:
        if output.suffix in _SINGLE_FILE_SUFFIXES and not output.is_dir():
            files = [_convert_to_file(args, output)]
        else:
            files = convert_zero_checkpoint_to_fp32_state_dict(
                args.checkpoint_dir, output, max_shard_size=args.max_shard_size,
                safe_serialization=args.safe_serialization, tag=args.tag,
                exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ValueError, NotImplementedError, OSError) as error:  # CheckpointError is a ValueError
        parser.exit(1, f"zero_to_fp32: {error}\n")
    log = logger.info if args.debug else logger.debug
    for file in files:
        log("zero_to_fp32: wrote %s", file)
    return 0


def _convert_to_file(args: argparse.Namespace, output: Path) -> Path:
    """Everything in one file at `output`: converted into a fresh folder beside it, then renamed."""
    output.parent.mkdir(parents=True, exist_ok=True)
    safe = args.safe_serialization or output.suffix == ".safetensors"
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".zero_to_fp32.") as scratch:
        (written,) = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, scratch, max_shard_size=2**62, safe_serialization=safe, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
        os.replace(written, output)  # replaces a link at `output` rather than writing through it
    return output



if __name__ == "__main__":
    sys.exit(main())
