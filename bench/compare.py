"""Step time, memory and communication side by side: a thin wrapper of `zerodp compare` (docs/compare.md).

    python bench/compare.py                  # TinyGPT 23.2M, 2 ranks, fp32 and bf16
    python bench/compare.py --stage3         # the ZeRO-3 set: ddp,fsdp2_3,deepspeed3,zerodp3,zerodp2
    python bench/compare.py --model small --dtypes fp32 --rounds 1

Each dtype is one `zerodp compare` run (fresh processes per framework, interleaved rounds) writing
bench/results/compare_<model>[_stage3]_<dtype>/report.md, results.json and the PNGs. Options after
the ones below (--rounds, --steps, --nproc, ...) go to `zerodp compare` unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp import cli  # noqa: E402

MODELS = {  # name -> (zerodp compare's MODEL, micro-batch)
    "small": ("gpt:vocab_size=256,seq_len=64,d_model=256,n_layer=4,n_head=4", 8),
    "gpt23m": ("gpt:vocab_size=8192,seq_len=128,d_model=512,n_layer=6,n_head=8", 2),
}
DEFAULT = "ddp,fsdp2,deepspeed1,deepspeed2,zerodp0,zerodp1,zerodp2"
STAGE3 = "ddp,fsdp2_3,deepspeed3,zerodp3,zerodp2"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt23m")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--frameworks", default=None, help=f"default {DEFAULT}; with --stage3 {STAGE3}")
    parser.add_argument("--stage3", action="store_true", help=f"shorthand for --frameworks {STAGE3}")
    args, rest = parser.parse_known_args()
    model, micro_batch = MODELS[args.model]
    frameworks = args.frameworks or (STAGE3 if args.stage3 else DEFAULT)
    results = Path(__file__).resolve().parent / "results"
    code = 0
    for dtype in args.dtypes.split(","):
        out = results / f"compare_{args.model}{'_stage3' if args.stage3 else ''}_{dtype}"
        code = max(code, cli.main(["compare", model, "--frameworks", frameworks, "--micro-batch", str(micro_batch),
                                   "--dtype", dtype, "--rounds", "2", "--steps", "5", *rest, "--out", str(out)]))
    return code


if __name__ == "__main__":
    sys.exit(main())
