"""Flat stage 3 against hpZ and MiCS on 2 hosts x 2 ranks: bytes per link from the ledger, step time.

    python bench/hierarchy.py                          # inter-node link limited to 1 Gbit/s each way
    python bench/hierarchy.py --rate none --steps 6    # the link as fast as the machine

The hosts are network namespaces on this machine (tests/netns.py, needs root); the ranks of one
host talk over its loopback, the hosts over veth pairs and a bridge, whose egress is limited with
`tc tbf` to --rate to stand for a slower network between machines. Each mode trains the same GPT
(--d-model, 4 blocks, fp32, AdamW) at ZeRO stage 3 for --steps steps in fresh processes, round
after round (--rounds, modes interleaved); the step time is the median over steps after the first
and over rounds. Bytes are every rank's comm ledger for the last step, split by link (a group on one
host: intra-node; spanning both: inter-node; see zerodp/comm/ledger.py's [Note: links]). Results go to
bench/results/hierarchy.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = {"flat": {}, "hpz": {"zero_hpz_partition_size": 2}, "mics": {"mics_shard_size": 2}}

_JOB = """
import json, os, statistics, sys, time
import torch
import zerodp
from zerodp.demo import GPTConfig, TinyGPT

zero, steps, d_model = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = TinyGPT(GPTConfig(vocab_size=64, seq_len=32, d_model=d_model, n_layer=4, n_head=4))
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
engine, *_ = zerodp.initialize(model=model, config=config)
rank = torch.distributed.get_rank()
times = []
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 64, (4, 32), generator=g)
    start = time.perf_counter()
    loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
    times.append(time.perf_counter() - start)
link = engine.comm_report()["last_step"]["link_bytes"]
held = engine.memory_report()["held"]
row = torch.tensor([link["intra_node"], link["inter_node"], statistics.median(times[1:])], dtype=torch.float64)
rows = zerodp.comm.all_gather_rows(row).tolist()
if rank == 0:
    print(json.dumps({"intra_node": [r[0] for r in rows], "inter_node": [r[1] for r in rows],
                      "step_s": max(r[2] for r in rows), "held": held,
                      "params": sum(p.ds_numel for p in model.parameters())}))
"""


def _run_mode(hosts, script: str, zero: dict, steps: int, d_model: int, port: int) -> dict:
    from tests.harness import json_objects

    zerodp = [sys.executable, "-c", "from zerodp.cli import main; raise SystemExit(main())"]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ZERODP_TIMEOUT": "300", "PATH": "/usr/bin:/bin"}
    procs = []
    for node_rank, host in enumerate(hosts):
        launch = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--local-addr", host.address, "--node-rank",
                  str(node_rank), "--master-addr", hosts[0].address, "--master-port", str(port)]
        procs.append(host.popen([*zerodp, *launch, script, json.dumps(zero), str(steps), str(d_model)], env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a host's job failed:\n" + "\n".join((o + e)[-3000:] for o, e in outs))
    (result,) = [obj for out, _ in outs for obj in json_objects(out) if "step_s" in obj]
    return result


def _limit(hosts, rate: str) -> None:
    for host in hosts:
        subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", host.interface, "root",
                        "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate of each host's link to the others (none: unlimited)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    import pytest

    from tests.netns import hosts

    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(_JOB)
        try:
            with hosts(2) as on:
                if args.rate != "none":
                    _limit(on, args.rate)
                port = 29700
                for round_ in range(args.rounds):
                    for mode in modes:
                        port += 1
                        results[mode].append(_run_mode(on, str(script), MODES[mode], args.steps, args.d_model, port))
                        print(f"round {round_ + 1}/{args.rounds} {mode}: {results[mode][-1]['step_s']:.3f} s/step",
                              file=sys.stderr)
        except pytest.skip.Exception as skipped:
            print(f"bench/hierarchy.py: {skipped}", file=sys.stderr)
            return 2
    _report(results, args)
    return 0


def _report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    flat_s = statistics.median(r["step_s"] for r in results.get("flat", results[next(iter(results))]))
    first = results[next(iter(results))][0]
    print(f"stage 3, {first['params']:,} parameters fp32, 2 hosts x 2 ranks, inter-node link {args.rate}; "
          "bytes per rank per step (rank 0)")
    print(f"{'mode':<6} {'step s':>8} {'vs flat':>8} {'inter-node':>14} {'intra-node':>14} {'param bytes held':>17}")
    summary = {}
    for mode, runs in results.items():
        step_s = statistics.median(r["step_s"] for r in runs)
        r = runs[0]
        held = sum(tiers.get("device", 0) for cat, tiers in r["held"].items() if cat in ("param32_master", "param_secondary"))
        print(f"{mode:<6} {step_s:>8.3f} {step_s / flat_s:>7.2f}x {int(r['inter_node'][0]):>14,} "
              f"{int(r['intra_node'][0]):>14,} {held:>17,}")
        summary[mode] = {"step_s": step_s, "inter_node_bytes": r["inter_node"], "intra_node_bytes": r["intra_node"],
                         "param_bytes_held": held, "runs": [x["step_s"] for x in runs]}
    out = REPO / "bench" / "results" / "hierarchy.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rate": args.rate, "steps": args.steps, "rounds": args.rounds,
                               "params": first["params"], "modes": summary}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
