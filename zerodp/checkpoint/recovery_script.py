"""The `zero_to_fp32.py` that save_checkpoint leaves in every checkpoint folder, as DeepSpeed does (and
so do `zerodp ckpt gather` and `zerodp ckpt convert --to zerodp`, whose outputs are checkpoint folders too):

    python checkpoints/zero_to_fp32.py checkpoints out/          # pytorch_model*.bin (+ index)
    cd checkpoints && python zero_to_fp32.py . out/ --safe_serialization

It is a few lines that import zerodp (which must be installed where it runs) and run DeepSpeed's
command line over zerodp's converter (zerodp.cli.zero_to_fp32, which also reads
DeepSpeed's own checkpoint folders): the flags and the files written are DeepSpeed 0.19's.
"""

from __future__ import annotations

from pathlib import Path

from zerodp.checkpoint.safe_io import replace_atomically

SCRIPT_NAME = "zero_to_fp32.py"

SCRIPT = '''#!/usr/bin/env python
"""Consolidate this zerodp (ZeRO) checkpoint into fp32 weights, with DeepSpeed's zero_to_fp32.py flags.

    python zero_to_fp32.py . out/                            # pytorch_model*.bin (+ index when sharded)
    python zero_to_fp32.py . out/ --safe_serialization       # model*.safetensors
    python zero_to_fp32.py . out/ -t global_step100          # a tag other than `latest`

Written by zerodp (save_checkpoint, `zerodp ckpt gather`, `zerodp ckpt convert --to zerodp`);
`python zero_to_fp32.py --help` lists every flag.
"""
import sys

try:
    from zerodp.cli.zero_to_fp32 import main
except ImportError as error:
    sys.exit(f"zero_to_fp32.py: this checkpoint was written by zerodp, which this Python cannot import "
             f"({error}); install zerodp (pip install zerodp) or run it with the environment that trained")

if __name__ == "__main__":
    sys.exit(main())
'''


def write_recovery_script(checkpoint_dir: Path) -> None:
    """Write (or replace) `checkpoint_dir/zero_to_fp32.py`, fresh and renamed into place (safe_io)."""
    replace_atomically(Path(checkpoint_dir) / SCRIPT_NAME, lambda f: f.write(SCRIPT.encode()))
