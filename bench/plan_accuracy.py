"""The planner against real runs on this CPU: does its pick fit, is it the fastest, is its time right?

    python bench/plan_accuracy.py            # 2 models x 3 device-memory budgets, 2 ranks (~25 min)
    python bench/plan_accuracy.py --quick    # one model, two budgets (~5 min)
    python bench/plan_accuracy.py --budgets 0.75 --stages 0,1 --activation-checkpointing none --rounds 6
                                             # a closer look at two near-tied candidates (~8 min)

For each model this machine is measured first (a torchrun job of 2 ranks, as training runs): the
model's own forward and backward at two micro-batch sizes (seconds per micro-batch and FLOP/s, from
the FLOPs zerodp.plan.planner.count_flops counts), a gloo all-reduce of 16 MB and of one element
(bandwidth, latency) and fused AdamW over half the model (elements/s). These become the cluster's figures
(`zerodp plan --gpu cpu --tflops ... --micro-batch-overhead ... --intra-node-bandwidth ... --latency
... --device-adam-rate ...`). For each device-memory budget, `zerodp.plan.planner.plan(...,
exhaustive=True)` lists every strategy and checkpointing policy at its largest micro-batch that fits;
then one torchrun job trains each of them for real: two steps under ZERODP_DEVICE_MEMORY_LIMIT=budget
(the OOM doctor's live-bytes watch enforces it on the CPU): does it fit; then, without the limit
(whose count slows every op), `--rounds` rounds over the candidates, interleaved, of `--steps` timed
steps each: the median of the rounds' medians, and their spread. Checked per
case: the pick (the plan's first) fits when run, its measured time is within 10% of the fastest
candidate that fit, and its predicted time within 25% of its measured one. Results go to
bench/results/plan_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {
    "GPT 7M": "gpt:vocab_size=4096,seq_len=128,d_model=256,n_layer=6,n_head=4",
    "GPT 19M": "gpt:vocab_size=8192,seq_len=128,d_model=384,n_layer=8,n_head=6",
}
BUDGETS = (1.2, 0.75, 0.5)  # of stage 0's simulated peak at the largest micro-batch
RANKS, GLOBAL_BATCH, SEQ_LEN, DTYPE = 2, 16, 128, "fp32"

_PROBE = """
import json, statistics, sys, time
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from zerodp.plan.workload import workload
from zerodp.plan.planner import count_flops

spec, per_rank, seq_len, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
torch.manual_seed(0)
work = workload(spec)
model = work.build()

def timed(fn, repeat=5):
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier(); start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return statistics.median(times)

def micro(m):
    args, kwargs = work.inputs(model, m, seq_len, torch.device("cpu"))
    def run():
        out = model(*args, **kwargs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    return run

small, large = timed(micro(1)), timed(micro(per_rank))
flops_small, flops_large = count_flops(work, 1, seq_len), count_flops(work, per_rank, seq_len)
rate = (flops_large - flops_small) / max(large - small, 1e-9)
overhead = max(small - flops_small / rate, 0.0)
big, one = torch.ones(4 * 2**20), torch.ones(1)
all_reduce, tiny = timed(lambda: dist.all_reduce(big)), timed(lambda: dist.all_reduce(one), 20)
bandwidth = 2 * big.numel() * 4 * (dist.get_world_size() - 1) / dist.get_world_size() / max(all_reduce - tiny, 1e-9)
numel = sum(p.numel() for p in model.parameters()) // dist.get_world_size()
param = torch.nn.Parameter(torch.zeros(numel)); param.grad = torch.ones(numel)
adam = torch.optim.AdamW([param], fused=True)  # as zerodp.optim builds it on a CPU or GPU
adam_rate = numel / timed(adam.step)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(dict(peak_flops=rate, micro_batch_overhead=overhead, intra_node_bandwidth=bandwidth,
                       collective_latency=tiny, device_adam_rate=adam_rate), f)
dist.destroy_process_group()
"""

_TRAIN = """
import gc, json, os, statistics, sys, time
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
import zerodp
from zerodp import checkpointing
from zerodp.plan.doctor import OutOfMemoryDiagnosed
from zerodp.plan.workload import workload
from zerodp.plan.simulate import train_steps

spec, seq_len, jobs, out = sys.argv[1], int(sys.argv[2]), json.loads(open(sys.argv[3]).read()), sys.argv[4]
limit, rounds, steps = sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
dist.init_process_group("gloo")
work = workload(spec)

def run(job, steps, limited):  # the median seconds of `steps` timed steps after one untimed
    if limited:
        os.environ["ZERODP_DEVICE_MEMORY_LIMIT"] = limit
    torch.manual_seed(0)
    model = work.build()
    if job["activation_checkpointing"] != "none":
        checkpointing.apply(model, "blocks")
    config = dict(job["config"], steps_per_print=10**6)
    micro = config["train_micro_batch_size_per_gpu"]
    batch = lambda m, device: work.inputs(m, micro, seq_len, device)
    try:
        engine, *_ = zerodp.initialize(model=model, config=config)
        train_steps(engine, batch, 1)
        times = []
        for _ in range(steps):
            dist.barrier(); start = time.perf_counter(); train_steps(engine, batch, 1); dist.barrier()
            times.append(time.perf_counter() - start)
        return statistics.median(times) if times else None
    finally:
        os.environ.pop("ZERODP_DEVICE_MEMORY_LIMIT", None)
        engine = model = None
        gc.collect()

results = []
for job in jobs:  # does it fit? Two steps under the limit (the first steps reach the peak)
    try:
        run(job, 1, limited=True)
        results.append({{"fits": True, "rounds": []}})
    except OutOfMemoryDiagnosed as err:
        results.append({{"fits": False, "why": str(err).splitlines()[0][:300]}})
# Timed without the limit: under it every op pays for the live-bytes count. Rounds interleave the
# candidates, so a slow minute of the machine falls on all of them alike.
for _ in range(rounds):
    for job, result in zip(jobs, results):
        if result["fits"]:
            result["rounds"].append(run(job, steps, limited=False))
for result in results:
    if result["fits"]:
        result["seconds"] = statistics.median(result["rounds"])
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(results, f)
dist.destroy_process_group()
"""


def torchrun(script: str, args: list[str], env: dict | None = None) -> None:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(script.format(repo=str(REPO)))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={RANKS}", str(job), *args], capture_output=True, text=True,
                              env={**clean, "OMP_NUM_THREADS": "1", "ZERODP_DOCTOR_DIR": tmp, **(env or {})})
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def probe(spec: str) -> dict:
    """This machine's figures for `spec`'s model, measured on RANKS concurrent ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(_PROBE, [spec, str(GLOBAL_BATCH // RANKS), str(SEQ_LEN), f"{tmp}/probe.json"])
        return json.loads(Path(f"{tmp}/probe.json").read_text())


def measure(spec: str, result, rounds: int, steps: int) -> list[dict]:
    """Train every candidate of `result` (a Plan) under its budget, `rounds` times interleaved, `steps`
    timed steps each time: whether it fits, the median step time of each round and their median."""
    jobs = [{"activation_checkpointing": c.activation_checkpointing, "config": c.ds_config(result.global_batch)}
            for c in result.candidates]
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/jobs.json").write_text(json.dumps(jobs))
        torchrun(_TRAIN, [spec, str(SEQ_LEN), f"{tmp}/jobs.json", f"{tmp}/out.json", str(result.cluster.gpu_memory_bytes),
                          str(rounds), str(steps)])
        return json.loads(Path(f"{tmp}/out.json").read_text())


def run_case(name: str, spec: str, figures: dict, fraction: float, reference_peak: int, rounds: int,
             steps: int, stages: tuple[int, ...] = (0, 1, 2, 3), policies: tuple[str, ...] = ("none", "blocks")) -> dict:
    from zerodp.plan.cluster import gpu_cluster
    from zerodp.plan.workload import workload
    from zerodp.plan.planner import plan

    budget = int(reference_peak * fraction)
    cluster = gpu_cluster("cpu", gpus_per_node=RANKS, gpu_memory_bytes=budget, efficiency=1.0, **figures)
    result = plan(workload(spec), cluster, SEQ_LEN, GLOBAL_BATCH, DTYPE, policies, exhaustive=True)
    result.candidates[:] = [c for c in result.candidates if c.strategy.stage in stages]
    measured = measure(spec, result, rounds, steps)
    rows = [{**c.as_dict(), "predicted_seconds": c.time.total, **m} for c, m in zip(result.candidates, measured)]
    fitting = [r for r in rows if r["fits"]]
    pick = rows[0] if rows else None
    case = {"model": name, "budget_bytes": budget, "budget_fraction": fraction, "candidates": rows,
            "why": result.why(), "pick_fits": bool(pick and pick["fits"])}
    if pick and pick["fits"] and fitting:
        fastest = min(fitting, key=lambda r: r["seconds"])
        case.update(pick=pick["strategy"], pick_micro_batch=pick["micro_batch"], fastest=fastest["strategy"],
                    pick_vs_fastest=pick["seconds"] / fastest["seconds"] - 1,
                    predicted_vs_measured=pick["predicted_seconds"] / pick["seconds"] - 1)
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first model, two budgets")
    parser.add_argument("--rounds", type=int, default=3, help="times each candidate is measured, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per candidate and round")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                        help="device-memory budgets, fractions of stage 0's simulated peak (default %(default)s)")
    parser.add_argument("--stages", default="0,1,2,3", help="the stages whose candidates run (default %(default)s)")
    parser.add_argument("--activation-checkpointing", default="none,blocks", help="policies (default %(default)s)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "plan_accuracy.json"))
    args = parser.parse_args()
    from zerodp.plan.model_states import StrategySpec
    from zerodp.plan.workload import workload
    from zerodp.plan.simulate import simulate_strategy

    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    budgets = BUDGETS[::2] if args.quick else tuple(float(b) for b in args.budgets.split(","))
    stages = tuple(int(s) for s in args.stages.split(","))
    policies = tuple(args.activation_checkpointing.split(","))
    cases, calibration = [], {}
    for name, spec in models.items():
        figures = calibration[name] = probe(spec)
        print(f"{name}: this machine: {figures['peak_flops'] / 1e9:.1f} GFLOP/s per rank, "
              f"{figures['micro_batch_overhead'] * 1e3:.1f} ms per micro-batch, all-reduce "
              f"{figures['intra_node_bandwidth'] / 1e9:.2f} GB/s + {figures['collective_latency'] * 1e6:.0f} us, "
              f"AdamW {figures['device_adam_rate'] / 1e6:.0f}M elements/s", flush=True)
        per_rank = GLOBAL_BATCH // RANKS
        reference = simulate_strategy(workload(spec), StrategySpec(0, dtype=DTYPE), RANKS, per_rank, SEQ_LEN, device="cpu")
        for fraction in budgets:
            case = run_case(name, spec, figures, fraction, reference.peak["device"].bytes, args.rounds, args.steps,
                            stages, policies)
            cases.append(case)
            _print_case(case)
    ok = [c for c in cases if "pick_vs_fastest" in c]
    print(f"{len(cases)} cases: pick fits in {sum(c['pick_fits'] for c in cases)}; within 10% of the fastest measured "
          f"in {sum(c['pick_vs_fastest'] <= 0.10 for c in ok)}; predicted step time within 25% in "
          f"{sum(abs(c['predicted_vs_measured']) <= 0.25 for c in ok)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ranks": RANKS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
                                          "dtype": DTYPE, "calibration": calibration, "cases": cases}, indent=1))


def _print_case(case: dict) -> None:
    print(f"  budget {case['budget_bytes'] / 1e6:.1f} MB ({case['budget_fraction']:.2f} x stage 0's peak):")
    for i, r in enumerate(case["candidates"]):
        spread = r["fits"] and (max(r["rounds"]) - min(r["rounds"])) / r["seconds"]
        got = f"measured {r['seconds']:.3f} s (rounds within {100 * spread:.0f}%)" if r["fits"] else \
            f"DID NOT FIT ({r['why'][:80]})"
        print(f"    {'pick' if i == 0 else '    '} {r['strategy']:<28} micro {r['micro_batch']} x {r['gradient_accumulation_steps']}"
              f"  peak {r['peak_bytes'] / 1e6:7.1f} MB  predicted {r['predicted_seconds']:.3f} s  {got}", flush=True)
    if "pick_vs_fastest" in case:
        print(f"    pick vs fastest measured ({case['fastest']}): {100 * case['pick_vs_fastest']:+.1f}%; predicted vs "
              f"measured: {100 * case['predicted_vs_measured']:+.1f}%", flush=True)


if __name__ == "__main__":
    main()
