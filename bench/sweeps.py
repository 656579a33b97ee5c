"""What the bucket sizes and the micro-batch do to step time and memory, on one model.

    python bench/sweeps.py                 # GPT 7M, 2 ranks, fp32, 2 rounds (~6 min)
    python bench/sweeps.py --rounds 1
    python bench/sweeps.py --only clipping --rounds 5

Four sweeps of zerodp on a 7.1M-parameter GPT (the demo's model at d_model 256, 6 layers, 128
tokens), each point one launch of zerodp/report/launch.py's (fresh processes, memory from the
allocator's count, rank 0's median step), the points interleaved over `--rounds`:
- `reduce_bucket_size` at stage 2, micro-batch 4: how many gradient elements are packed before a
  reduction starts (the seed's "what does bucket size affect": the transient bucket against the
  number of collectives);
- `stage3_prefetch_bucket_size` at stage 3, micro-batch 4 (0: no prefetch);
- the micro-batch at stage 2, one micro-batch per step (the seed's "why do tiny micro-batches hurt":
  tokens/s as the step's fixed costs are spread over more samples);
- `gradient_clipping` at stage 2, micro-batch 4: what clipping by the global norm costs (the step
  column is engine.step()'s time, where the clip runs).
Results: a table per sweep on stdout and bench/results/sweeps.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp.report.launch import launch  # noqa: E402

MODEL = "gpt:vocab_size=4096,seq_len=128,d_model=256,n_layer=6,n_head=4"
SWEEPS = {
    "reduce_bucket_size (stage 2, micro-batch 4)": [
        ("zerodp2", 4, {"zero_optimization": {"reduce_bucket_size": b}}, f"{b:.0e}")
        for b in (100_000, 1_000_000, 5_000_000, 500_000_000)],
    "stage3_prefetch_bucket_size (stage 3, micro-batch 4)": [
        ("zerodp3", 4, {"zero_optimization": {"stage3_prefetch_bucket_size": b}}, f"{b:.0e}" if b else "0 (none)")
        for b in (0, 1_000_000, 50_000_000)],
    "micro-batch (stage 2)": [("zerodp2", m, {}, str(m)) for m in (1, 2, 4, 8, 16)],
    "gradient_clipping (stage 2, micro-batch 4)": [("zerodp2", 4, {"gradient_clipping": c}, str(c)) for c in (0.0, 1.0)],
}  # (framework, micro-batch, config keys over zerodp/report/runners.py's, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", default="", help="run the sweeps whose name contains this (default: all)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sweeps.json"))
    args = parser.parse_args()
    sweeps = {name: points for name, points in SWEEPS.items() if args.only in name}
    if not sweeps:
        raise SystemExit(f"--only {args.only!r} names none of the sweeps: {', '.join(SWEEPS)}")
    points = [(sweep, p) for sweep, ps in sweeps.items() for p in ps]
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            for i, (sweep, (framework, micro, config, label)) in enumerate(points):
                job = {"framework": framework, "model": MODEL, "micro_batch": micro, "seq_len": 128, "dtype": "fp32",
                       "steps": args.steps, "warmup": 2, "memory": round_ == 0, "timeout": 600, "config": config,
                       "log": f"{logs}/{i}-{round_}-rank{{rank}}.log"}
                result = launch(job, 2)
                if "error" in result:
                    raise SystemExit(f"{sweep} {label}: {result['error']}\n{result['traceback']}")
                results.setdefault((sweep, label), []).append(result)
                print(f"round {round_ + 1}/{args.rounds}: {sweep} = {label}: "
                      f"{statistics.median(t['total'] for t in result['times']):.4f} s/step", file=sys.stderr, flush=True)
    report = []
    for sweep, ps in sweeps.items():
        print(f"\n{sweep}\n| value | s/step | step ms | tokens/s | peak MB | transient MB | rounds |\n"
              "|---|---|---|---|---|---|---|")
        for framework, micro, config, label in ps:
            launches = results[(sweep, label)]
            seconds = statistics.median(t["total"] for l in launches for t in l["times"])
            step = statistics.median(t["step"] for l in launches for t in l["times"])
            first = launches[0]
            row = {"sweep": sweep, "value": label, "micro_batch": micro, "config": config, "seconds": seconds,
                   "step_seconds": step,
                   "tokens_per_s": micro * 128 * 2 / seconds, "peak": first["peak"],
                   "transient": first["peak"] - first["live"],
                   "rounds": [statistics.median(t["total"] for t in l["times"]) for l in launches]}
            report.append(row)
            print(f"| {label} | {seconds:.4f} | {1e3 * step:.1f} | {row['tokens_per_s']:,.0f} | {row['peak'] / 1e6:.1f} | "
                  f"{row['transient'] / 1e6:.1f} | {', '.join(f'{r:.4f}' for r in row['rounds'])} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
