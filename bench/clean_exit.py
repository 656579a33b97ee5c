"""How often a finished 2-rank job exits 0: zerodp (a DeepSpeed-style script and the demo) beside
torch DDP, under torchrun and `zerodp run`.

    python bench/clean_exit.py --runs 200                      # everything below, 200 runs each
    python bench/clean_exit.py --runs 50 --only zerodp-torchrun --stages 3

A finished gloo job can abort at interpreter exit ("terminate called without an active
exception", exit -6; torch issue #190489): see [Note: leaving nothing for interpreter shutdown] in
zerodp/comm/lifecycle.py. The scripts never call destroy_process_group, as DeepSpeed's and most users' do not.
Runs are sequential (2 ranks on this machine's 2 cores); results go to bench/results/clean_exit.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ZERODP_SCRIPT = """
import os, torch
import zerodp as deepspeed
from zerodp.demo import DEMO_DEFAULT, SyntheticTaskDataset, TinyGPT

deepspeed.init_distributed()
torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": int(os.environ["STAGE"]), "stage3_param_persistence_threshold": 1000}}
data = SyntheticTaskDataset(4 * 2 * int(os.environ["WORLD_SIZE"]), DEMO_DEFAULT.seq_len, DEMO_DEFAULT.vocab_size, seed=0)
engine, _, loader, _ = deepspeed.initialize(model=TinyGPT(DEMO_DEFAULT), config=config, training_data=data)
for idx, targets in loader:
    engine.backward(engine(idx, targets))
    engine.step()
"""

_DDP_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from zerodp.demo import DEMO_DEFAULT, TinyGPT

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(TinyGPT(DEMO_DEFAULT))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(4):
    idx = torch.randint(0, DEMO_DEFAULT.vocab_size, (2, DEMO_DEFAULT.seq_len))
    model(idx, idx).backward()
    optimizer.step()
    optimizer.zero_grad()
"""

_LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
              "zerodp-run": [sys.executable, "-m", "zerodp.cli", "run", "--nproc-per-node", "2"]}


def cases(stages: list[int], demo_steps: int, tmp: Path) -> dict[str, tuple[list[str], dict]]:
    """name -> (argv, extra environment) for every job measured."""
    (tmp / "zerodp_script.py").write_text(_ZERODP_SCRIPT)
    (tmp / "ddp_script.py").write_text(_DDP_SCRIPT)
    out = {}
    for launcher, argv in _LAUNCHERS.items():
        out[f"ddp-{launcher}"] = ([*argv, str(tmp / "ddp_script.py")], {})
        for stage in stages:
            out[f"zerodp-{launcher} stage {stage}"] = ([*argv, str(tmp / "zerodp_script.py")], {"STAGE": str(stage)})
    for stage in stages:
        out[f"zerodp demo stage {stage}"] = ([sys.executable, "-m", "zerodp.cli", "demo", "--stage", str(stage),
                                             "--steps", str(demo_steps)], {})
    return out


def run_once(argv: list[str], env: dict) -> tuple[int, bool]:
    """(exit code, whether gloo's exit abort was printed)."""
    proc = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    return proc.returncode, "terminate called without an active exception" in proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per case (default 200)")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages (default 0,1,2,3)")
    parser.add_argument("--demo-steps", type=int, default=4, help="--steps of `zerodp demo` (default 4)")
    parser.add_argument("--only", default=None, help="comma-separated case-name prefixes (default: all)")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    results: dict[str, collections.Counter] = {}
    with tempfile.TemporaryDirectory() as tmp:
        todo = cases(stages, args.demo_steps, Path(tmp))
        if args.only:
            todo = {k: v for k, v in todo.items() if any(k.startswith(p) for p in args.only.split(","))}
        for name, (argv, env) in todo.items():
            counts: collections.Counter = collections.Counter()
            start = time.monotonic()
            for i in range(args.runs):
                code, aborted = run_once(argv, env)
                counts[f"exit {code}" + (" (gloo abort printed)" if aborted else "")] += 1
                print(f"\r{name}: {i + 1}/{args.runs} {dict(counts)}", end="", file=sys.stderr, flush=True)
            print(f" ({time.monotonic() - start:.0f} s)", file=sys.stderr)
            results[name] = counts
    print("| job | runs | exit 0 | other exits |\n|---|---|---|---|")
    for name, counts in results.items():
        other = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "exit 0") or "-"
        print(f"| {name} | {sum(counts.values())} | {counts['exit 0']} | {other} |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "clean_exit.json").write_text(json.dumps({k: dict(v) for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
