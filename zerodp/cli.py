"""The `zerodp` command: run, config check, demo.

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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zerodp` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    if argv[:1] == ["run"]:  # everything after `run` belongs to torchrun and the script
        return _cmd_run(argv[1:])
    if argv[:1] == ["deepspeed"]:  # everything after `deepspeed` belongs to the launcher and the script
        return _cmd_deepspeed(argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


def _setup_logging() -> None:
    from zerodp.log import StderrHandler, logger

    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
    logger.setLevel(os.environ.get("ZERODP_LOG_LEVEL", "INFO"))


def _parser() -> argparse.ArgumentParser:
    from zerodp import cli_plan

    parser = argparse.ArgumentParser(prog="zerodp", description="ZeRO training engine for PyTorch (DeepSpeed-compatible).")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    sub.add_parser("run", help="launch a training script on N processes (torchrun's options; see `zerodp run --help`)")
    sub.add_parser("deepspeed", help="launch a DeepSpeed script with DeepSpeed's launcher flags (see `zerodp deepspeed --help`)")

    _add_config(sub)
    _add_ckpt(sub)
    _add_estimate(sub)
    cli_plan.add_parser(sub, cli_plan.cmd_plan)
    _add_doctor(sub)
    _add_compare(sub)
    _add_demo(sub)
    return parser


def _add_config(sub: argparse._SubParsersAction) -> None:
    """`zerodp config check`."""
    config = sub.add_parser("config", help="check a DeepSpeed config").add_subparsers(required=True, metavar="ACTION")
    check = config.add_parser("check", help="validate a config and print it resolved, with the batch math")
    check.add_argument("config", help="path to a DeepSpeed JSON config")
    check.add_argument("--world-size", type=int, default=None,
                       help="data-parallel world size (number of processes); default: $WORLD_SIZE")
    check.set_defaults(func=_cmd_config_check)


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    """`zerodp ckpt inspect | convert | gather`."""
    ckpt = sub.add_parser("ckpt", help="inspect or convert a zerodp checkpoint (convert: a DeepSpeed one too)").add_subparsers(required=True, metavar="ACTION")
    inspect_ = ckpt.add_parser("inspect", help="what saved a checkpoint and what its files hold")
    inspect_.add_argument("dir", help="checkpoint directory (with 'latest') or a tag directory")
    inspect_.add_argument("--tag", default=None, help="tag to read (default: the one in DIR/latest)")
    inspect_.set_defaults(func=_cmd_ckpt_inspect)
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
    convert.add_argument("--max-shard-size", default="5GB",
                         help="largest output file: 500MB, 5GB or 5G (powers of 1000), 5GiB (powers of 1024); default 5GB")
    convert.set_defaults(func=_cmd_ckpt_convert)
    gather = ckpt.add_parser("gather", help="one checkpoint from the hosts' directories of a save made with "
                                            "checkpoint.use_node_local_storage (copy them onto one machine first)")
    gather.add_argument("dirs", nargs="+", metavar="DIR", help="every host's checkpoint directory (or tag directory)")
    gather.add_argument("--out", required=True, help="directory to write OUT/TAG and OUT/latest into")
    gather.add_argument("--tag", default=None, help="tag to gather (default: the one in each DIR/latest)")
    gather.set_defaults(func=_cmd_ckpt_gather)


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    """`zerodp estimate`."""
    estimate = sub.add_parser("estimate", help="peak memory per rank for every ZeRO strategy, before a run")
    estimate.add_argument("model", nargs="?", default=None, metavar="MODEL",
                          help="demo (the demo's GPT), gpt:d_model=1024,n_layer=24,... (the demo's GPT at other sizes), "
                               "a Hugging Face config file or model directory, or module:function returning an "
                               "nn.Module; built on fake tensors (no weights), its training step simulated")
    estimate.add_argument("--params", default=None, metavar="N",
                          help="number of trainable parameters: 7.5e9, 7B, 350M, 125000000")
    estimate.add_argument("--world-size", default="1", metavar="N", help="data-parallel ranks (default 1)")
    estimate.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                          help="training precision (default bf16: 16-bit parameters and gradients, fp32 masters)")
    estimate.add_argument("--micro-batch", default="1", metavar="B", help="micro-batch size per rank (default 1)")
    estimate.add_argument("--seq-len", default=None, metavar="L",
                          help="tokens per sample (default: the model's longest, at most 2048)")
    estimate.add_argument("--activation-checkpointing", default="none", metavar="POLICIES",
                          help="comma-separated: none, blocks (every repeated block), selective (blocks, keeping "
                               "matmul and attention outputs), or all (default none)")
    estimate.add_argument("--model-states-only", action="store_true",
                          help="skip the simulated training step: model states only (seconds instead of minutes "
                               "for a 70B model)")
    estimate.add_argument("--largest-layer", default="0", metavar="N",
                          help="parameters of the largest module, for DeepSpeed's stage-3 figure beside zerodp's")
    estimate.add_argument("--json", action="store_true", help="print one JSON object per strategy and checkpointing policy")
    estimate.set_defaults(func=_cmd_estimate)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    """`zerodp doctor`."""
    doctor = sub.add_parser("doctor", help="show the OOM doctor's reports of a run that ran out of device memory")
    doctor.add_argument("path", metavar="LOGDIR_OR_REPORT",
                        help="a report (rank0.json) or the directory of them ($ZERODP_DOCTOR_DIR, default ./zerodp_oom)")
    doctor.add_argument("--json", action="store_true", help="print the reports as JSON")
    doctor.set_defaults(func=_cmd_doctor)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    """`zerodp compare`."""
    compare = sub.add_parser("compare", help="train one model with DDP, FSDP2, DeepSpeed and zerodp's strategies, "
                             "side by side: report.md and plots", description="Each framework trains in fresh "
                             "processes, interleaved over rounds; step time, peak memory by category, communication "
                             "against the ZeRO paper's volume, loss curves and a verdict go to DIR/report.md, with "
                             "PNG plots when matplotlib is installed (what is measured: zerodp/compare.py).")
    compare.add_argument("model", nargs="?", default="demo", metavar="MODEL",
                         help="as for zerodp estimate: demo (default), gpt:KEY=VALUE,..., a Hugging Face config file "
                              "or directory, or module:function")
    compare.add_argument("--nproc", type=_positive_int, default=2, help="ranks (default 2)")
    compare.add_argument("--frameworks", default=None, metavar="A,B,...",
                         help="comma-separated, from: " + ", ".join(_compare_frameworks()) + " (default: all)")
    compare.add_argument("--steps", type=_positive_int, default=10, help="timed optimizer steps per launch (default 10)")
    compare.add_argument("--rounds", type=_positive_int, default=3, help="launches of each framework, interleaved (default 3)")
    compare.add_argument("--warmup", type=_positive_int, default=2, help="untimed steps first, at least 2: memory is "
                         "measured through them (default 2)")
    compare.add_argument("--micro-batch", type=_positive_int, default=8, help="samples per rank and step (default 8)")
    compare.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sample (default: the "
                         "model's longest, at most 128)")
    compare.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="precision (default fp32)")
    compare.add_argument("--timeout", type=_positive_int, default=600, help="seconds one launch may take (default 600)")
    compare.add_argument("--out", required=True, metavar="DIR", help="where report.md, results.json and the PNGs go")
    compare.set_defaults(func=_cmd_compare)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """`zerodp demo`."""
    demo = sub.add_parser("demo", help="train a small GPT on a synthetic task, then show the memory ledger")
    demo.add_argument("--nproc", type=_positive_int, default=2, help="processes (ranks) to launch (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default: the demo's)")
    demo.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage (default 0)")
    demo.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="precision (default fp32)")
    demo.add_argument("--config", default=None, help="a DeepSpeed JSON config to start from (flags override it)")
    demo.add_argument("--activation-checkpointing", action="store_true",
                      help="checkpoint every transformer block (compare the saved-activation bytes with and without)")
    demo.set_defaults(func=_cmd_demo)


def _compare_frameworks() -> list[str]:
    from zerodp.compare import FRAMEWORKS

    return list(FRAMEWORKS)


def _compare_command(args: argparse.Namespace, names: list[str]) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    seq = f" --seq-len {args.seq_len}" if args.seq_len else ""
    return (f"zerodp compare {args.model} --nproc {args.nproc} --frameworks {','.join(names)} --steps {args.steps} "
            f"--rounds {args.rounds} --warmup {args.warmup} --micro-batch {args.micro_batch}{seq} --dtype {args.dtype} "
            f"--out {args.out}")


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zerodp.compare import CompareError, compare, parse_frameworks

    try:
        names = parse_frameworks(args.frameworks) if args.frameworks else _compare_frameworks()
        rows = compare(args.model, Path(args.out), names, nproc=args.nproc, steps=args.steps, rounds=args.rounds,
                       warmup=args.warmup, micro_batch=args.micro_batch, seq_len=args.seq_len, dtype=args.dtype,
                       timeout=args.timeout, command=_compare_command(args, names),
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (CompareError, ValueError) as err:
        print(f"zerodp compare: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {Path(args.out) / 'report.md'}")
    return EXIT_OK if any("error" not in r for r in rows) else EXIT_FAILED


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _cmd_run(argv: list[str]) -> int:
    from zerodp.launcher import launch

    if not argv or argv[0] in ("-h", "--help"):
        print(_run_help())
        return EXIT_OK if argv else EXIT_USAGE
    return launch(argv)


def _cmd_deepspeed(argv: list[str]) -> int:
    from zerodp.launcher import launch_deepspeed

    try:
        return launch_deepspeed(argv)
    except ValueError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE


def _run_help() -> str:
    from zerodp import launcher

    return "usage: zerodp run [torchrun options] SCRIPT [script args]\n" + (launcher.__doc__ or "")


def _cmd_config_check(args: argparse.Namespace) -> int:
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


def _cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from zerodp.checkpoint.convert import describe
    from zerodp.checkpoint.format import CheckpointError

    try:
        print(describe(args.dir, args.tag))
    except (CheckpointError, OSError) as err:
        print(f"zerodp ckpt inspect: {err}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _cmd_ckpt_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from zerodp.checkpoint import convert_to_safetensors, convert_to_torch
    from zerodp.checkpoint.convert import copy_hf_config, hf_config_problem
    from zerodp.sizes import parse_size
    from zerodp.checkpoint.deepspeed import convert_to_zerodp, find_tag_dir
    from zerodp.checkpoint.format import CheckpointError

    dtype = getattr(torch, _DTYPES[args.dtype])
    try:
        is_deepspeed = Path(args.dir).is_dir() and find_tag_dir(Path(args.dir), args.tag) is not None
    except CheckpointError as err:
        is_deepspeed, problem = False, str(err)
    else:
        problem = _convert_source_problem(args, is_deepspeed)
    problem = problem or (hf_config_problem(args.hf_config) if args.hf_config else None)
    if problem:  # before any weight is written
        print(f"zerodp ckpt convert: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        bar: list = []
        progress = _progress_into(bar)
        if args.to == "zerodp":
            files = convert_to_zerodp(args.dir, args.out, args.tag, progress)
        else:
            convert = convert_to_torch if args.to == "fp32" else convert_to_safetensors
            files = convert(args.dir, args.out, args.tag, dtype, parse_size(args.max_shard_size), progress)
        if args.hf_config:
            files += copy_hf_config(args.hf_config, args.out)
        if bar:
            bar[0].close()
    except (CheckpointError, OSError, ValueError) as err:
        print(f"zerodp ckpt convert: {err}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(str(f) for f in files))
    return EXIT_OK


def _progress_into(bar: list):
    """A (done, total) callback that draws a progress bar on stderr, made at the first call, into `bar`."""
    from zerodp.metrics import ProgressBar

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(ProgressBar(total, sys.stderr))
        bar[0].update(done)

    return progress


def _cmd_ckpt_gather(args: argparse.Namespace) -> int:
    from zerodp.checkpoint.format import CheckpointError
    from zerodp.checkpoint.gather import gather_checkpoint

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


def _cmd_estimate(args: argparse.Namespace) -> int:
    from zerodp.plan.estimate import ACTIVATION_CHECKPOINTING, estimate_rows, workload
    from zerodp.sizes import parse_count

    problems, module, work = [], None, None
    if args.params is None and args.model is None:
        problems.append("give MODEL (demo, gpt:..., a Hugging Face config, module:function) or --params N")
    elif args.params is not None and args.model is not None:
        problems.append("give either MODEL or --params, not both")
    elif args.model is not None:
        try:
            work = workload(args.model)
            module = work.meta()
        except ValueError as err:
            problems.append(str(err))
    numel = parse_count(args.params) if args.params is not None else None
    if module is not None:
        numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if args.params is not None and numel is None:
        problems.append(f"--params {args.params!r}: expected a number of parameters such as 7.5e9 or 7B")
    world, largest = parse_count(args.world_size), parse_count(args.largest_layer) if args.largest_layer != "0" else 0
    micro_batch = parse_count(args.micro_batch)
    if world is None:
        problems.append(f"--world-size {args.world_size}: expected a positive number of ranks")
    if largest is None:
        problems.append(f"--largest-layer {args.largest_layer}: expected a number of parameters")
    if micro_batch is None:
        problems.append(f"--micro-batch {args.micro_batch}: expected a positive number of samples")
    policies = ACTIVATION_CHECKPOINTING if args.activation_checkpointing == "all" else \
        tuple(dict.fromkeys(args.activation_checkpointing.split(",")))
    if any(p not in ACTIVATION_CHECKPOINTING for p in policies):
        problems.append(f"--activation-checkpointing {args.activation_checkpointing}: expected all or a comma-separated "
                        f"list of {', '.join(ACTIVATION_CHECKPOINTING)}")
    seq_len = None
    if work is not None and work.feeds(module) and not args.model_states_only:
        seq_len = parse_count(args.seq_len) if args.seq_len is not None else min(work.max_seq_len or 2048, 2048)
        if seq_len is None:
            problems.append(f"--seq-len {args.seq_len}: expected a positive number of tokens")
        elif work.max_seq_len is not None and seq_len > work.max_seq_len:
            problems.append(f"--seq-len {seq_len}: {args.model} takes at most {work.max_seq_len} tokens")
    elif work is not None or args.seq_len is not None or args.micro_batch != "1":
        why = "--params gives model states only" if work is None else "--model-states-only skips the step" \
            if args.model_states_only else f"{args.model} has no known input (a causal LM, or a module with " \
            "estimate_inputs(micro_batch, seq_len))"
        if args.seq_len is not None or args.micro_batch != "1":
            problems.append(f"--micro-batch/--seq-len: {why}")
    if problems:
        print("zerodp estimate: " + "; ".join(problems), file=sys.stderr)
        return EXIT_USAGE
    simulate = work if seq_len is not None else None
    progress = (lambda line: print(f"zerodp estimate: {line}", file=sys.stderr, flush=True)) if simulate else None
    from zerodp.plan.simulate import SimulationUnavailable

    try:
        rows = estimate_rows(numel, world, args.dtype, largest, module, simulate, micro_batch, seq_len or 0, policies,
                             progress)
    except ValueError as err:  # the model's own forward refused the input (a user's module:function)
        print(f"zerodp estimate: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SimulationUnavailable as err:
        print(f"zerodp estimate: no peak estimate ({err}); model states only", file=sys.stderr)
        rows, seq_len = estimate_rows(numel, world, args.dtype, largest, module), None
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    _print_estimate(args, rows, numel, world, micro_batch, seq_len)
    return EXIT_OK


def _print_estimate(args: argparse.Namespace, rows: list[dict], numel: int, world: int, micro_batch: int,
                    seq_len: int | None) -> None:
    what = f"{args.model}: " if args.model else ""
    top = max(max(r["model_states_bytes"], r["peak_bytes"] or 0) for r in rows)
    unit, scale = ("GB", 1e9) if top >= 1e9 else ("MB", 1e6)
    shape = f", micro-batch {micro_batch} x {seq_len} tokens" if seq_len else ""
    print(f"memory per rank: {what}{numel:,} trainable parameters, Adam, {args.dtype}, {world} ranks{shape} "
          f"({unit} = 10^{round(math.log10(scale))} bytes)")
    peaks = seq_len is not None
    width = max(len(r["strategy"]) for r in rows)
    head = ["model states", "peak"] if peaks else ["device"]
    head += ["host", "nvme", "DeepSpeed"]
    policy_width = 10 if peaks else 0
    print(f"  {'strategy':<{width}} " + (f"{'ckpt':<{policy_width}}" if peaks else "")
          + " ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = [r["model_states_bytes"]] + ([r["peak_bytes"]] if peaks else []) + \
            [r["host_bytes"], r["nvme_bytes"], r["deepspeed_bytes"]]
        print(f"  {r['strategy']:<{width}} " + (f"{r['activation_checkpointing']:<{policy_width}}" if peaks else "")
              + " ".join(f"{'-' if b is None else f'{b / scale:.2f}':>12}" for b in cells))
    failed = sorted({r["peak_error"] for r in rows if r.get("peak_error")})
    if failed:
        print(f"peak not estimated ('-') where the simulated step failed: {'; '.join(failed)}")
    if peaks:
        print("peak: the most bytes live at once on the device over two simulated training steps (zerodp's "
              "own engine on fake tensors: model states, activations, gathered units, buckets, the step's gradient copy; "
              "attention as a GPU's flash kernels run it; the allocator's fragmentation and the CUDA context come on top)")
    else:
        print("model states only (parameters, gradients, fp32 masters, Adam's state): give MODEL for the peak with "
              "activations and transient buffers")
    print("host, nvme: model states offloaded there. DeepSpeed: what its estimate_zero2/3_model_states_mem_needs_all_cold "
          "print per GPU (converted from GiB), where it estimates; it adds the step's fp32 gradient copy (4 bytes per "
          "parameter / ranks) and, at stage 3, 4 bytes per parameter of the largest layer (--largest-layer), which "
          "zerodp counts as transients. Parameters offloaded to nvme stay in host memory up to offload_param.max_in_cpu "
          "(1e9) elements per rank")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from zerodp.plan.doctor import format_report, load_reports

    try:
        reports = load_reports(args.path)
    except ValueError as err:
        print(f"zerodp doctor: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(reports, indent=1) if args.json else "\n\n".join(format_report(r) for r in reports))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from zerodp.config import ConfigError, load_config
    from zerodp.demo import train as train_script
    from zerodp.demo.train import demo_config

    try:
        config = demo_config(args.config, stage=args.stage, dtype=args.dtype)
        load_config(config, world_size=args.nproc)  # fail here, not in N tracebacks
    except (ConfigError, OSError) as err:
        print(f"zerodp demo: {err}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="zerodp-demo-") as tmp:
        path = os.path.join(tmp, "ds_config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        # The script by path, not `-m zerodp.demo.train`: -m puts the working directory first on
        # sys.path, and a directory there named zerodp (a checkout's root) would shadow the package.
        argv = ["--nproc-per-node", str(args.nproc), train_script.__file__, "--config", path]
        if args.steps is not None:
            argv += ["--steps", str(args.steps)]
        if args.activation_checkpointing:
            argv.append("--activation-checkpointing")
        _quiet_demo_children()
        return _cmd_run(argv)


def _quiet_demo_children() -> None:
    """A new user should see the demo's own lines: no torchrun banner about OMP_NUM_THREADS (set to
    what torchrun would set), no zerodp INFO lines that repeat the demo's header, no torch warning
    about a NumPy zerodp does not need."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("ZERODP_LOG_LEVEL", "WARNING")
    ignore = "ignore:Failed to initialize NumPy"  # the children import torch before zerodp's own filter
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), ignore]))


if __name__ == "__main__":
    sys.exit(main())
