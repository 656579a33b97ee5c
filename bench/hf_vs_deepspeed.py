"""The same Hugging Face scripts on zerodp (ZERODP_AS_DEEPSPEED=1) and on a real DeepSpeed.

    pip install -e '.[test,bench]'          # transformers, peft, accelerate, trl, deepspeed
    python bench/hf_vs_deepspeed.py --stages 2,3 --jobs trainer,dpo,grpo

Each job is a script of tests/scripts/ run unchanged on 2 processes under each framework, the only
difference being the switch (and DS_ACCELERATOR=cpu for DeepSpeed on a machine without a GPU):
- trainer: hf_trainer.py (tiny GPT-2 from a config, PEFT LoRA, bf16, an all-"auto" DeepSpeed config,
  4 steps, a checkpoint at step 2 resumed): per-step losses, the evaluation loss, resumed bitwise;
- dpo: trl_dpo.py (TRL's DPOTrainer with its reference model, tiny Llama, bf16, 4 steps): loss,
  rewards/chosen and rewards/margins per step;
- grpo: trl_grpo.py (TRL's GRPOTrainer, generation in the loop, KL to the reference, 3 steps): loss,
  reward and KL per step.
The table gives each framework's curves and the largest difference between them.
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
SCRIPTS = {"trainer": "hf_trainer.py", "dpo": "trl_dpo.py", "grpo": "trl_grpo.py"}


def curves(job: str, result: dict) -> dict[str, list[float]]:
    """The numbers a job logs, as named series."""
    if job == "trainer":
        return {"loss": result["losses"], "eval loss": [result["eval_loss"]]}
    return {key: [row[key] for row in result["logs"]] for key in result["logs"][0]}


def run(job: str, stage: int, framework: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["ZERODP_AS_DEEPSPEED"] = "1" if framework == "zerodp" else "0"
    if framework == "deepspeed":
        env.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "tests" / "scripts" / SCRIPTS[job]), str(stage), str(out)]
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
    parser.add_argument("--jobs", default="trainer,dpo,grpo", help=f"of {','.join(SCRIPTS)} (default: all)")
    args = parser.parse_args()
    try:
        import deepspeed  # noqa: F401 - a real DeepSpeed must be installed for the comparison
    except ImportError:
        print("a real DeepSpeed is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    print("| job | stage | framework | curves (per logged step) | resumed bitwise |")
    print("|---|---|---|---|---|")
    for job in args.jobs.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            results = {}
            for framework in ("zerodp", "deepspeed"):
                print(f"running {job} at stage {stage} on {framework} ...", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    results[framework] = r = run(job, stage, framework, Path(tmp))
                if "error" in r:
                    print(f"| {job} | {stage} | {framework} | failed: {r['error'][-300:]!r} | |")
                    continue
                shown = "; ".join(f"{k}: {', '.join(f'{x:.7g}' for x in v)}" for k, v in curves(job, r).items())
                print(f"| {job} | {stage} | {framework} | {shown} | {r.get('resumed_bitwise', '')} |")
            if all("error" not in r for r in results.values()):
                a, b = (curves(job, results[f]) for f in ("zerodp", "deepspeed"))
                diff = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
                print(f"| {job} | {stage} | largest difference | {diff:.2e} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
