"""The same Hugging Face Trainer script on zerodp (ZERODP_AS_DEEPSPEED=1) and on a real DeepSpeed.

    pip install -e '.[test,bench]'          # transformers, peft, accelerate, deepspeed
    python bench/hf_vs_deepspeed.py --stages 2,3

tests/scripts/hf_trainer.py (tiny GPT-2 from a config, PEFT LoRA, bf16, an all-"auto" DeepSpeed config,
4 steps, a checkpoint at step 2 resumed) runs on 2 processes under each, the only difference being
the switch (and DS_ACCELERATOR=cpu for DeepSpeed on a machine without a GPU). The table gives each
one's per-step losses and evaluation loss, the largest difference, and whether each resumed bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer.py"


def run(stage: int, framework: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["ZERODP_AS_DEEPSPEED"] = "1" if framework == "zerodp" else "0"
    if framework == "deepspeed":
        env.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               str(stage), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-1500:]}
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"')))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="2,3", help="ZeRO stages (default 2,3)")
    args = parser.parse_args()
    try:
        import deepspeed  # noqa: F401 - a real DeepSpeed must be installed for the comparison
    except ImportError:
        print("a real DeepSpeed is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    print("| stage | framework | losses (steps 1-4) | eval loss | resumed bitwise |")
    print("|---|---|---|---|---|")
    for stage in (int(s) for s in args.stages.split(",")):
        results = {}
        for framework in ("zerodp", "deepspeed"):
            with tempfile.TemporaryDirectory() as tmp:
                results[framework] = r = run(stage, framework, Path(tmp))
            if "error" in r:
                print(f"| {stage} | {framework} | failed: {r['error'][-300:]!r} | | |")
                continue
            print(f"| {stage} | {framework} | {', '.join(f'{x:.7f}' for x in r['losses'])} | {r['eval_loss']:.7f} "
                  f"| {r['resumed_bitwise']} |")
        if all("error" not in r for r in results.values()):
            a, b = results["zerodp"], results["deepspeed"]
            diff = max(abs(x - y) for x, y in zip(a["losses"] + [a["eval_loss"]], b["losses"] + [b["eval_loss"]]))
            print(f"| {stage} | largest difference | {diff:.2e} | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
