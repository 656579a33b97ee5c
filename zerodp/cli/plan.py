"""`zerodp plan`: its arguments and its output (the search is zerodp/plan/planner.py).

    zerodp plan demo --gpus-per-node 8 --nodes 2 --gpu-memory 80GB --seq-len 32 --global-batch 256
    zerodp plan docs/models/llama-7b --gpu h100 --nodes 4 --seq-len 2048 --global-batch 512 --output ds.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, add_zeropp_flags, zeropp_from_flags

# flag -> (Cluster field, kind, help); kind "size": 80GB, "rate": 300GB (bytes/s), "float", "int"
CLUSTER_FLAGS = {
    "--gpus-per-node": ("gpus_per_node", "int", "ranks (GPUs) per node (default 8)"),
    "--nodes": ("nodes", "int", "nodes (default 1)"),
    "--gpu-memory": ("gpu_memory_bytes", "size", "memory per GPU, e.g. 80GB (default: the --gpu preset's)"),
    "--host-memory": ("host_memory_bytes", "size", "host memory per node (default 1TB)"),
    "--nvme": ("nvme_bytes", "size", "NVMe space per node for offload (default none: no NVMe candidates)"),
    "--tflops": ("peak_flops", "tflops", "dense peak TFLOP/s per GPU in the training dtype (default: the preset's)"),
    "--efficiency": ("efficiency", "float", "fraction of the peak a large micro-batch reaches (default 0.45)"),
    "--micro-batch-overhead": ("micro_batch_overhead", "float", "seconds per micro-batch beyond its FLOPs (default 0.005)"),
    "--intra-node-bandwidth": ("intra_node_bandwidth", "rate", "ring bandwidth per GPU inside a node, e.g. 300GB "
                               "(bytes/s; default: the preset's NVLink)"),
    "--inter-node-bandwidth": ("inter_node_bandwidth", "rate", "bandwidth per GPU across nodes (default 25GB: 200 Gbit/s)"),
    "--latency": ("collective_latency", "float", "seconds per collective call (default 3e-05)"),
    "--overlap": ("overlap", "float", "fraction of min(communication, compute) hidden behind compute (default 0.8)"),
    "--host-device-bandwidth": ("host_device_bandwidth", "rate", "host-GPU copy bandwidth per GPU (default: the preset's PCIe)"),
    "--disk-bandwidth": ("disk_bandwidth", "rate", "NVMe bandwidth per node (default 3GB)"),
    "--device-adam-rate": ("device_adam_rate", "float", "Adam elements per second on a GPU (default: memory bandwidth / 28 B)"),
    "--host-adam-rate": ("host_adam_rate", "float", "Adam elements per second on a node's CPU cores (default 2e9)"),
    "--headroom": ("headroom", "float", "fraction of GPU memory kept free for fragmentation and the CUDA context (default 0.1)"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp plan`."""
    plan = sub.add_parser("plan", help="the ZeRO configs that fit a cluster, fastest first; the best as DeepSpeed JSON",
                          description="Simulates zerodp's engine at the cluster's world size for every strategy "
                          "(stage, offload, activation checkpointing) and finds the largest micro-batch that fits; "
                          "ranks them by a predicted step time (the model: zerodp/plan/cluster.py).")
    plan.add_argument("model", metavar="MODEL", help="as for zerodp estimate: demo, gpt:KEY=VALUE,..., a Hugging Face "
                      "config file or directory, or module:function")
    plan.add_argument("--gpu", default="h100", help="a preset: a100-40gb, a100-80gb, h100, h200, or cpu (ranks on CPU "
                      "cores with gloo); flags below override its figures (default h100)")
    plan.add_argument("--seq-len", required=True, metavar="L", help="tokens per sample")
    plan.add_argument("--global-batch", required=True, metavar="B", help="samples per optimizer step, all ranks together")
    plan.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="precision (default bf16)")
    plan.add_argument("--activation-checkpointing", default="none,blocks", metavar="POLICIES",
                      help="policies to try, comma-separated: none, blocks, selective (default none,blocks)")
    for flag, (_, _, text) in CLUSTER_FLAGS.items():
        plan.add_argument(flag, default=None, help=text)
    plan.add_argument("--quantization", choices=["none", "nf4"], default=None,
                      help="nf4: QLoRA, as zerodp estimate --quantization nf4 (a 4-bit frozen base, LoRA adapters train). "
                           "Default: the model config's quantization_config, else none")
    plan.add_argument("--lora-rank", default=None, metavar="R", help="adapter rank with --quantization nf4 (default 8)")
    plan.add_argument("--lora-targets", default="all-linear", metavar="NAMES",
                      help="the Linear layers adapted: all-linear (default) or names such as q_proj,v_proj")
    plan.add_argument("--double-quant", action="store_true", help="bnb_4bit_use_double_quant")
    plan.add_argument("--sequence-parallel", default="1", metavar="S",
                      help="split each sequence over S ranks (Ulysses, sequence_parallel_size; a Hugging Face model). "
                           "Default 1, and when nothing fits although the model states do, the plan tries 2, 4, 8, ... "
                           "and proposes the smallest that fits")
    add_zeropp_flags(plan, hpz=False)  # the stage-3 candidates run with them
    plan.add_argument("--exhaustive", action="store_true", help="simulate dominated candidates too (slower)")
    plan.add_argument("--top", type=int, default=10, help="candidates shown (default 10)")
    plan.add_argument("--output", default=None, metavar="PATH", help="write the best candidate as a DeepSpeed JSON config")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)


def cluster_from(args: argparse.Namespace, problems: list[str]) -> "Cluster | None":
    """The Cluster the flags describe; problems appended (naming the flag) instead of raising."""
    from zerodp.plan.cluster import gpu_cluster
    from zerodp.sizes import parse_size

    overrides: dict = {}
    for flag, (name, kind, _) in CLUSTER_FLAGS.items():
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        try:
            if kind in ("size", "rate"):
                value = parse_size(text, what=flag)
            else:
                value = int(text) if kind == "int" else float(text) * (1e12 if kind == "tflops" else 1)
                if not value > 0 and not (name in ("overlap", "headroom") and value == 0):
                    raise ValueError
                if name in ("overlap", "headroom", "efficiency") and value > 1:
                    raise ValueError
        except ValueError as err:
            problems.append(str(err) if kind in ("size", "rate") else
                            f"{flag} {text!r}: expected a {'whole number >= 1' if kind == 'int' else 'number > 0'}"
                            + (" and <= 1" if name in ("overlap", "headroom", "efficiency") else ""))
            continue
        overrides[name] = value
    try:
        return gpu_cluster(args.gpu, **overrides)
    except ValueError as err:
        problems.append(str(err))
        return None


def cmd_plan(args: argparse.Namespace) -> int:
    """Check every flag (all problems on one line, exit 2), plan, print the table or JSON and write
    --output; exit 1 when nothing fits."""
    from zerodp.plan.planner import plan
    from zerodp.sizes import parse_count

    problems: list[str] = []
    cluster = cluster_from(args, problems)
    work = _qlora(args, _workload(args, problems), problems)
    seq_len, global_batch = _batch(args, work, cluster, problems)
    policies = _policies(args, problems)
    sp = parse_count(args.sequence_parallel)
    if sp is None:
        problems.append(f"--sequence-parallel {args.sequence_parallel!r}: expected a whole number of ranks >= 1")
    zeropp = zeropp_from_flags(args, None if cluster is None else cluster.world_size, sp or 1, problems)
    if problems:
        print("zerodp plan: " + "; ".join(problems), file=sys.stderr)
        return EXIT_USAGE
    say = lambda line: print(f"zerodp plan: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        result = plan(work, cluster, seq_len, global_batch, args.dtype, policies, args.exhaustive, say,
                      sequence_parallel=sp, zeropp=zeropp)
    except ValueError as err:
        print(f"zerodp plan: {err}", file=sys.stderr)
        return EXIT_USAGE
    best = result.candidates[0] if result.candidates else None
    if args.output and best is not None:
        with open(args.output, "w") as f:
            json.dump(best.ds_config(global_batch), f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps({"cluster": asdict(cluster), "seq_len": seq_len, "global_batch": global_batch,
                          "candidates": [c.as_dict() for c in result.candidates], "left_out": result.left_out,
                          "why": result.why(), "best_config": best.ds_config(global_batch) if best else None,
                          "simulations": result.simulations, "sequence_parallel": result.sequence_parallel,
                          "sequence_note": result.sequence_note}, indent=1))
    else:
        _print_plan(args, result)
    return EXIT_OK if best is not None else EXIT_FAILED


def _workload(args: argparse.Namespace, problems: list[str]) -> "Workload | None":
    from zerodp.plan.workload import workload

    try:
        return workload(args.model)
    except ValueError as err:
        problems.append(str(err))
        return None


def _qlora(args: argparse.Namespace, work: "Workload | None", problems: list[str]) -> "Workload | None":
    """The workload QLoRA trains (zerodp/plan/quantized.py) with --quantization nf4 or the model config's
    quantization_config (read as zerodp estimate reads it), its flags checked on a meta build."""
    from zerodp.cli.common import quantize_from_flags
    from zerodp.plan.quantized import qlora_workload

    if work is None:
        return None
    qlora = quantize_from_flags(args, work.meta(), problems, "plan")  # None: unquantized, or a flag is wrong
    return work if qlora is None else qlora_workload(work, qlora, args.dtype)


def _batch(args: argparse.Namespace, work: "Workload | None", cluster: "Cluster | None",
           problems: list[str]) -> tuple[int | None, int | None]:
    """--seq-len (at most the model's longest) and --global-batch (a multiple of the ranks)."""
    from zerodp.sizes import parse_count

    seq_len, global_batch = (parse_count(getattr(args, k)) for k in ("seq_len", "global_batch"))
    if seq_len is None:
        problems.append(f"--seq-len {args.seq_len!r}: expected a whole number of tokens >= 1")
    elif work is not None and work.max_seq_len is not None and seq_len > work.max_seq_len:
        problems.append(f"--seq-len {seq_len}: {args.model} takes at most {work.max_seq_len} tokens")
    if global_batch is None:
        problems.append(f"--global-batch {args.global_batch!r}: expected a whole number of samples >= 1")
    elif cluster is not None and global_batch % cluster.world_size:
        problems.append(f"--global-batch {global_batch}: not a multiple of the {cluster.world_size} ranks "
                        f"(--gpus-per-node {cluster.gpus_per_node} x --nodes {cluster.nodes})")
    return seq_len, global_batch


def _policies(args: argparse.Namespace, problems: list[str]) -> tuple[str, ...]:
    from zerodp.plan.estimate import ACTIVATION_CHECKPOINTING

    policies = tuple(dict.fromkeys(args.activation_checkpointing.split(",")))
    if any(p not in ACTIVATION_CHECKPOINTING for p in policies):
        problems.append(f"--activation-checkpointing {args.activation_checkpointing}: expected a comma-separated list "
                        f"of {', '.join(ACTIVATION_CHECKPOINTING)}")
    return policies


def _print_plan(args: argparse.Namespace, result: "Plan") -> None:
    from zerodp.sizes import decimal_size

    c = result.cluster
    print(f"plan: {args.model}, {c.nodes} node(s) x {c.gpus_per_node} {c.name} ({decimal_size(c.gpu_memory_bytes)} each, "
          f"{decimal_size(c.usable_bytes)} usable), {result.global_batch} samples x {result.seq_len} tokens per step, "
          f"{args.dtype}" + (f", sequence parallel {result.sequence_parallel}" if result.sequence_parallel > 1 else ""))
    if not result.candidates:
        print(f"nothing fits: {result.why()}")
    split = result.sequence_parallel > 1  # a column for Ulysses' all-to-alls, a part of comm
    head = f"  {'#':>2} {'strategy':<44} {'micro x acc':>11} {'peak':>9} {'step s':>8} {'compute':>8} {'comm':>8} " \
           + (f"{'a2a':>8} " if split else "") + f"{'optim':>8} {'offload':>8}"
    if result.candidates:
        print(head)
    for i, cand in enumerate(result.candidates[:args.top], 1):
        t = cand.time
        print(f"  {i:>2} {cand.describe():<44} {f'{cand.micro_batch} x {cand.accumulation}':>11} "
              f"{decimal_size(cand.peak_bytes):>9} {t.total:>8.3g} {t.compute:>8.3g} {t.exposed_communication:>8.3g} "
              + (f"{t.all_to_all:>8.3g} " if split else "") + f"{t.optimizer:>8.3g} {t.offload:>8.3g}")
    if result.candidates:
        print(f"why: {result.why()}")
        print("comm: communication not hidden behind compute" + (
              f", a2a of it Ulysses' all-to-alls inside groups of {result.sequence_parallel} ranks" if split else "") +
              "; step times are predictions (zerodp/plan/cluster.py: the step-time "
              f"model); {result.simulations} simulated steps, {len(result.left_out)} candidates left out (--json lists why)")
    best = result.candidates[0] if result.candidates else None
    if best is not None and best.activation_checkpointing != "none":
        print(f"note: a DeepSpeed config does not turn on activation checkpointing: apply it to the model "
              f"(zerodp.checkpointing.apply(model, 'blocks'{', selective=True' if best.activation_checkpointing == 'selective' else ''}) "
              "or Hugging Face's model.gradient_checkpointing_enable())")
    if best is not None and best.sequence_parallel > 1:
        print(f"note: sequence_parallel_size {best.sequence_parallel} needs the model's attention wrapped and each batch cut "
              "along the sequence (zerodp.sequence.register_attention, shard_batch; docs/long_sequences.md)")
    if args.output and best is not None:
        print(f"wrote {args.output} (check it with: zerodp config check {args.output} --world-size {c.world_size})")

