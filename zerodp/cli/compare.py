"""`zerodp compare`: its arguments and its output (the runs and the report are zerodp/report/)."""

from __future__ import annotations

import argparse
import sys

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp compare`."""
    from zerodp.launcher import OVERSUBSCRIBE_HELP

    compare = sub.add_parser("compare", help="train one model with DDP, FSDP2, DeepSpeed and zerodp's strategies, "
                             "side by side: report.md and plots", description="Each framework trains in fresh "
                             "processes, interleaved over rounds; step time, peak memory by category, communication "
                             "against the ZeRO paper's volume, loss curves and a verdict go to DIR/report.md, with "
                             "PNG plots when matplotlib is installed (what is measured: zerodp/report/__init__.py).")
    compare.add_argument("model", nargs="?", default="demo", metavar="MODEL",
                         help="as for zerodp estimate: demo (default), gpt:KEY=VALUE,..., a Hugging Face config file "
                              "or directory, or module:function")
    compare.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    compare.add_argument("--allow-oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    compare.add_argument("--frameworks", default=None, metavar="A,B,...",
                         help="comma-separated, from: " + ", ".join(_frameworks()) + " (default: all)")
    compare.add_argument("--steps", type=positive_int, default=10, help="timed optimizer steps per launch (default 10)")
    compare.add_argument("--rounds", type=positive_int, default=3, help="launches of each framework, interleaved (default 3)")
    compare.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first, at least 2: memory is "
                         "measured through them (default 2)")
    compare.add_argument("--micro-batch", type=positive_int, default=8, help="samples per rank and step (default 8)")
    compare.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sample (default: the "
                         "model's longest, at most 128)")
    compare.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="precision (default fp32)")
    compare.add_argument("--timeout", type=positive_int, default=600, help="seconds one launch may take (default 600)")
    compare.add_argument("--out", required=True, metavar="DIR", help="where report.md, results.json and the PNGs go")
    compare.set_defaults(func=cmd_compare)


def _frameworks() -> list[str]:
    from zerodp.report import FRAMEWORKS

    return list(FRAMEWORKS)


def _command(args: argparse.Namespace, names: list[str]) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    seq = f" --seq-len {args.seq_len}" if args.seq_len else ""
    allow = " --allow-oversubscribe" if args.allow_oversubscribe else ""
    return (f"zerodp compare {args.model} --nproc {args.nproc}{allow} --frameworks {','.join(names)} "
            f"--steps {args.steps} --rounds {args.rounds} --warmup {args.warmup} --micro-batch {args.micro_batch}{seq} "
            f"--dtype {args.dtype} --out {args.out}")


def cmd_compare(args: argparse.Namespace) -> int:
    """Run the comparison, progress on stderr; exit 0 when at least one framework ran, 1 when none did."""
    from pathlib import Path

    from zerodp.launcher import check_local_ranks
    from zerodp.report import CompareError, compare, parse_frameworks

    try:
        check_local_ranks(f"--nproc {args.nproc}", args.nproc, args.allow_oversubscribe)
        names = parse_frameworks(args.frameworks) if args.frameworks else _frameworks()
        rows = compare(args.model, Path(args.out), names, nproc=args.nproc, steps=args.steps, rounds=args.rounds,
                       warmup=args.warmup, micro_batch=args.micro_batch, seq_len=args.seq_len, dtype=args.dtype,
                       timeout=args.timeout, command=_command(args, names),
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (CompareError, ValueError) as err:
        print(f"zerodp compare: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {Path(args.out) / 'report.md'}")
    return EXIT_OK if any("error" not in r for r in rows) else EXIT_FAILED
