"""`zerodp estimate`: peak memory per rank for every ZeRO strategy, before a run (zerodp/plan/estimate.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from zerodp.cli.common import EXIT_OK, EXIT_USAGE, add_zeropp_flags, zeropp_from_flags


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    estimate.add_argument("--quantization", choices=["none", "nf4"], default=None,
                          help="nf4: QLoRA, a 4-bit frozen base (bitsandbytes NF4, stored in the training dtype) with "
                               "LoRA adapters, the only parameters that train (needs MODEL; model states only). Default: "
                               "the model config's quantization_config, else none")
    estimate.add_argument("--lora-rank", default=None, metavar="R", help="adapter rank with --quantization nf4 (default 8)")
    estimate.add_argument("--lora-targets", default="all-linear", metavar="NAMES",
                          help="the Linear layers adapted: all-linear (default, as PEFT) or comma-separated module "
                               "names such as q_proj,v_proj")
    estimate.add_argument("--double-quant", action="store_true",
                          help="bnb_4bit_use_double_quant: quantize the 4-bit statistics too (0.52 instead of 0.56 "
                               "bytes per frozen weight)")
    estimate.add_argument("--sequence-parallel", default="1", metavar="S",
                          help="Ulysses sequence parallelism: each sequence split over S of the --world-size ranks "
                               "(sequence_parallel_size; a Hugging Face model whose heads S splits; default 1)")
    add_zeropp_flags(estimate, hpz=True)
    estimate.add_argument("--json", action="store_true", help="print one JSON object per strategy and checkpointing policy")
    estimate.set_defaults(func=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Check every flag (all problems on one line, exit 2), then estimate and print the table or JSON."""
    problems: list[str] = []
    work, module, numel = _model(args, problems)
    world, largest, micro_batch = _counts(args, problems)
    policies = _policies(args, problems)
    seq_len = _seq_len(args, work, module, problems)
    sp = _sequence_parallel(args, world, module, seq_len, problems)
    zeropp = zeropp_from_flags(args, world, sp, problems)
    if problems:
        print("zerodp estimate: " + "; ".join(problems), file=sys.stderr)
        return EXIT_USAGE
    estimated = _estimate(args, numel, world, largest, module, work, micro_batch, seq_len, policies, sp, zeropp)
    if estimated is None:
        return EXIT_USAGE
    rows, seq_len = estimated
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    _print_estimate(args, rows, numel, world, micro_batch, seq_len)
    _print_sequence_parallel(rows[0], micro_batch, seq_len)
    _print_zeropp(rows, zeropp)
    return EXIT_OK


def _model(args: argparse.Namespace, problems: list[str]) -> tuple[Any, Any, int | None]:
    """The workload and its module on the meta device (MODEL), and the trainable parameters (either)."""
    from zerodp.cli.common import quantize_from_flags
    from zerodp.plan.workload import workload
    from zerodp.sizes import parse_count

    module, work = None, None
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
    if module is None:
        args.quantization = args.quantization or "none"
    else:
        quantize_from_flags(args, module, problems, "estimate")  # the QLoRA model, as plan reads it
        numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if args.params is not None and numel is None:
        problems.append(f"--params {args.params!r}: expected a number of parameters such as 7.5e9 or 7B")
    return work, module, numel


def _counts(args: argparse.Namespace, problems: list[str]) -> tuple[int | None, int | None, int | None]:
    """--world-size, --largest-layer (0: not given) and --micro-batch."""
    from zerodp.sizes import parse_count

    world, largest = parse_count(args.world_size), parse_count(args.largest_layer) if args.largest_layer != "0" else 0
    micro_batch = parse_count(args.micro_batch)
    if world is None:
        problems.append(f"--world-size {args.world_size}: expected a positive number of ranks")
    if largest is None:
        problems.append(f"--largest-layer {args.largest_layer}: expected a number of parameters")
    if micro_batch is None:
        problems.append(f"--micro-batch {args.micro_batch}: expected a positive number of samples")
    return world, largest, micro_batch


def _policies(args: argparse.Namespace, problems: list[str]) -> tuple[str, ...]:
    """The activation checkpointing policies to estimate, from --activation-checkpointing."""
    from zerodp.plan.estimate import ACTIVATION_CHECKPOINTING

    policies = ACTIVATION_CHECKPOINTING if args.activation_checkpointing == "all" else \
        tuple(dict.fromkeys(args.activation_checkpointing.split(",")))
    if any(p not in ACTIVATION_CHECKPOINTING for p in policies):
        problems.append(f"--activation-checkpointing {args.activation_checkpointing}: expected all or a comma-separated "
                        f"list of {', '.join(ACTIVATION_CHECKPOINTING)}")
    return policies


def _seq_len(args: argparse.Namespace, work: Any, module: Any, problems: list[str]) -> int | None:
    """Tokens per sample of the simulated step; None when no step is simulated (model states only)."""
    from zerodp.sizes import parse_count

    quantized = args.quantization != "none"
    if quantized and args.model is None:
        problems.append("--quantization nf4: give MODEL (a Hugging Face config, demo, ...): which weights are "
                        "Linear layers decides what is quantized")
    if quantized or args.lora_rank is not None or args.double_quant or args.lora_targets != "all-linear":
        if not quantized:
            problems.append("--lora-rank/--lora-targets/--double-quant: only with --quantization nf4")
        if args.seq_len is not None or args.micro_batch != "1":
            problems.append("--micro-batch/--seq-len: --quantization nf4 estimates model states only (a 4-bit "
                            "step is not simulated)")
        return None
    if work is not None and work.feeds(module) and not args.model_states_only:
        seq_len = parse_count(args.seq_len) if args.seq_len is not None else min(work.max_seq_len or 2048, 2048)
        if seq_len is None:
            problems.append(f"--seq-len {args.seq_len}: expected a positive number of tokens")
        elif work.max_seq_len is not None and seq_len > work.max_seq_len:
            problems.append(f"--seq-len {seq_len}: {args.model} takes at most {work.max_seq_len} tokens")
        return seq_len
    if args.seq_len is not None or args.micro_batch != "1":
        why = "--params gives model states only" if work is None else "--model-states-only skips the step" \
            if args.model_states_only else f"{args.model} has no known input (a causal LM, or a module with " \
            "estimate_inputs(micro_batch, seq_len))"
        problems.append(f"--micro-batch/--seq-len: {why}")
    return None


def _sequence_parallel(args: argparse.Namespace, world: int | None, module: Any, seq_len: int | None,
                       problems: list[str]) -> int:
    """--sequence-parallel: a size the world, the model's heads and the sequence take (the runtime's rules)."""
    from zerodp.plan.sequence import model_heads, sequence_parallel_problems
    from zerodp.sizes import parse_count

    sp = parse_count(args.sequence_parallel)
    if sp is None:
        problems.append(f"--sequence-parallel {args.sequence_parallel}: expected a positive number of ranks per sequence")
        return 1
    if world is not None:
        problems.extend(sequence_parallel_problems(sp, world, model_heads(module), args.model))
    if seq_len is not None and seq_len % sp:
        problems.append(f"--seq-len {seq_len} does not divide by --sequence-parallel {sp}: each rank holds an equal "
                        f"shard (the runtime pads to a multiple or refuses); use {seq_len + -seq_len % sp}")
    return sp


def _estimate(args: argparse.Namespace, numel: int, world: int, largest: int, module: Any, work: Any,
              micro_batch: int, seq_len: int | None, policies: tuple[str, ...],
              sp: int, zeropp: Any) -> tuple[list[dict], int | None] | None:
    """The rows (Ulysses over `sp` ranks, the ZeRO++ keys of `zeropp`: zerodp/plan/zeropp.py) and the sequence
    length they were simulated at (None: model states only, also when the simulation is unavailable here);
    None when the model's own forward refused the input (said on stderr)."""
    from zerodp.plan.estimate import estimate_rows
    from zerodp.plan.simulate import SimulationUnavailable

    simulate = work if seq_len is not None else None
    progress = (lambda line: print(f"zerodp estimate: {line}", file=sys.stderr, flush=True)) if simulate else None
    try:
        rows = estimate_rows(numel, world, args.dtype, largest, module, simulate, micro_batch, seq_len or 0, policies,
                             progress, quantization=args.quantization, sequence_parallel=sp, zeropp=zeropp)
    except ValueError as err:  # the model's own forward refused the input (a user's module:function)
        print(f"zerodp estimate: {err}", file=sys.stderr)
        return None
    except SimulationUnavailable as err:
        print(f"zerodp estimate: no peak estimate ({err}); model states only", file=sys.stderr)
        return estimate_rows(numel, world, args.dtype, largest, module, quantization=args.quantization,
                             sequence_parallel=sp, zeropp=zeropp), None
    return rows, seq_len


def _print_estimate(args: argparse.Namespace, rows: list[dict], numel: int, world: int, micro_batch: int,
                    seq_len: int | None) -> None:
    what = f"{args.model}: " if args.model else ""
    top = max(max(r["model_states_bytes"], r["peak_bytes"] or 0) for r in rows)
    unit, scale = ("GB", 1e9) if top >= 1e9 else ("MB", 1e6)
    shape = f", micro-batch {micro_batch} x {seq_len} tokens" if seq_len else ""
    base = f" (LoRA rank {args.lora_rank or 8}, the frozen base in NF4)" if args.quantization == "nf4" else ""
    print(f"memory per rank: {what}{numel:,} trainable parameters{base}, Adam, {args.dtype}, {world} ranks{shape} "
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
    _print_footnotes(peaks, args.quantization)


def _print_footnotes(peaks: bool, quantization: str = "none") -> None:
    if quantization == "nf4":
        print("model states only (a 4-bit step is not simulated): the frozen base's packed NF4 weights are param4bit "
              "(sharded at stage 3), their quantization statistics quant_state, held whole on every rank; only the LoRA "
              "adapters have gradients, fp32 masters and Adam's state")
    elif peaks:
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


def _print_sequence_parallel(row: dict, micro_batch: int, seq_len: int | None) -> None:
    """The sequence-parallel line under the table: S, the tokens a rank holds, its all-to-all bytes."""
    sp, exchanged = row["sequence_parallel"], row["all_to_all_bytes"]
    if sp == 1:
        return
    print(f"sequence parallel {sp}: ZeRO partitions over all {row['world_size']} ranks (the model states above), "
          f"{row['world_size'] // sp} data-parallel replica(s) of {sp} ranks that share each sequence"
          + (f"; each rank holds {seq_len // sp} of the {seq_len} tokens outside attention, all of them for 1/{sp} "
             "of the heads inside it" if seq_len else ""))
    if exchanged:
        print(f"all-to-all per rank and micro-batch of {micro_batch}: {exchanged['forward_per_layer']:,} bytes per layer "
              f"forward (q, k, v, output), {exchanged['backward_per_layer']:,} backward"
              + (f", the forward's again in the recompute of {exchanged['recomputed_layers']} checkpointed layers"
                 if exchanged["recomputed_layers"] else "") + f", {exchanged['per_micro_batch']:,} "
              f"over {exchanged['layers']} layers ({(sp - 1) / sp:.0%} of it leaves the rank)")


def _print_zeropp(rows: list[dict], zeropp: Any) -> None:
    """The ZeRO++ lines under the table: which rows use it, and the first simulated stage-3 row's collectives."""
    if not zeropp:
        return
    print(f"ZeRO++ {zeropp.describe()}: stage-3 rows (below stage 3 the keys are ignored, as DeepSpeed ignores them"
          + ("; hpZ's secondary copy is param_secondary, and parameter offload, which hpZ refuses, is left out"
             if zeropp.hpz_partition_size > 1 else "") + ")")
    row = next((r for r in rows if r["stage"] == 3 and r.get("comm_ops")), None)
    if row is None:
        return
    ops = ", ".join(f"{op} {rec['bytes']:,}" for op, rec in row["comm_ops"].items())
    links = {link: sum(rec["link_bytes"].get(link, 0) for rec in row["comm_ops"].values())
             for link in ("intra_node", "inter_node")}
    split = f"; nodes of {zeropp.hpz_partition_size} ranks: {links['inter_node']:,} across nodes, " \
        f"{links['intra_node']:,} inside them" if zeropp.hpz_partition_size > 1 else ""
    print(f"collectives per step and rank, {row['strategy']}: {ops} bytes (int8 payloads, float32 scales){split}")
