"""Real training frameworks, unchanged, on zerodp (ZERODP_AS_DEEPSPEED=1) and on a real DeepSpeed: losses step by step.

    python bench/frameworks.py --transformers-src ~/src/transformers --deepspeed-examples ~/src/DeepSpeedExamples \\
        [--deepspeed-python /work/benchvenv/bin/python] [--jobs clm,trl_sft,llamafactory,dschat_sft,dschat_rm]

The scripts are the projects' own, run as their users run them, never edited: transformers'
`examples/pytorch/language-modeling/run_clm.py` (from the checkout --transformers-src names), TRL's
`trl/scripts/sft.py` (from the installed trl) under `accelerate launch --config_file` with TRL's own
ZeRO-3 accelerate config, `llamafactory-cli train` with LLaMA-Factory's `examples/deepspeed/ds_z3_config.json`
(--llamafactory-src, --llamafactory-python), and DeepSpeed-Chat's step-1 SFT and step-2 reward-model
`main.py` (from --deepspeed-examples). Inputs are local (tests/framework_inputs.py: a tiny Llama, a BPE
tokenizer trained on local text, the text); nothing reaches a hub. Each job runs on 2 processes under
both frameworks with one interpreter (--deepspeed-python, which has a real DeepSpeed): the switch
ZERODP_AS_DEEPSPEED=1 and PYTHONPATH=this repository make `import deepspeed` resolve to zerodp.

What differs between the two runs, and why (nothing in the scripts):
- DeepSpeed on CPU (DS_ACCELERATOR=cpu): the Hugging Face Trainer needs `--use_cpu` to accept bf16 on a
  machine without a GPU, and with it accelerate never initialises deepspeed.comm, so DeepSpeed's
  `zero.Init` (which transformers enters before the engine exists) computes the batch with a world size
  of 1 and refuses the "auto"-filled train_batch_size. A `sitecustomize` (written under the work folder,
  on DeepSpeed's PYTHONPATH only) calls `deepspeed.init_distributed("gloo")` in each rank first, which is
  what accelerate does on a GPU. zerodp needs none of it.
- run_clm.py imports `evaluate` at the top and uses it only under --do_eval; where the package is not
  installed a stand-in is put on the path for both frameworks (these runs do not evaluate).

It prints, per job, both loss curves, the largest |difference| and at which step, and the resume checks:
run_clm.py resumed by zerodp from its own checkpoint must equal the uninterrupted run bitwise (losses
after the checkpoint and the saved weights), and zerodp resumed from DeepSpeed's own checkpoint-N must
follow DeepSpeed's uninterrupted curve within the band.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.framework_jobs import JOBS, Job  # noqa: E402
from tests.framework_inputs import make_inputs  # noqa: E402

_SITECUSTOMIZE = '''import os
# a real DeepSpeed on CPU: initialise its comm as accelerate does on a GPU (bench/frameworks.py); once per
# rank: the marker keeps the rank's own child interpreters (DeepSpeed's py-cpuinfo probe) from joining
if os.environ.get("LOCAL_RANK") is not None and not os.environ.get("BENCH_DS_COMM_STARTED"):
    os.environ["BENCH_DS_COMM_STARTED"] = "1"
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
'''


_ZERODP_HOOK = (REPO / "zerodp_as_deepspeed.pth").read_text()


def environment(framework: str, work: Path, shims: Path, python: str) -> dict[str, str]:
    """The environment of one run: the switch, the stand-ins, offline hubs, one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONHASHSEED": "0", "WANDB_DISABLED": "true"}
    paths = []
    if framework == "zerodp":
        env["ZERODP_AS_DEEPSPEED"] = "1"
        # zerodp_as_deepspeed.pth installs the switch at start-up where zerodp is pip-installed; an
        # interpreter without it (LLaMA-Factory's own venv) gets the same hook as a sitecustomize
        hook = work / "zerodp-hook"
        hook.mkdir(parents=True, exist_ok=True)
        (hook / "sitecustomize.py").write_text(_ZERODP_HOOK)
        paths += [str(REPO), str(hook)]
    else:
        env["ZERODP_AS_DEEPSPEED"] = "0"
        env.setdefault("DS_ACCELERATOR", "cpu")
        custom = work / "ds-cpu"
        custom.mkdir(parents=True, exist_ok=True)
        (custom / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        paths.append(str(custom))
        env["TORCH_EXTENSIONS_DIR"] = str(_private_extensions(work.parent))
    probe = subprocess.run([python, "-c", "import evaluate"], capture_output=True)
    if probe.returncode:
        paths.append(str(shims))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _private_extensions(work: Path) -> Path:
    """A private copy of torch's JIT-extension folder for DeepSpeed's CPU ops (fused_adam, shm comm).

    torch guards each op's build folder with a lock file, taken even to check an op already built; a
    process killed while holding it (a timeout on a shared machine) leaves the lock, and every later
    DeepSpeed run waits on it forever. A copy per bench run (under --work, shared by its jobs) keeps its
    lock files its own; the first DeepSpeed launch may rebuild the ops there (minutes on a small CPU)."""
    private = work / "torch-extensions"
    if not private.exists():
        shared = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
        if shared.is_dir():
            shutil.copytree(shared, private, ignore=shutil.ignore_patterns("lock"))
        else:
            private.mkdir(parents=True)
    return private


def run(command: list[str], env: dict, log: Path, timeout: float, cwd: Path | None = None) -> None:
    """Run one launch to completion; on failure raise with the log's tail."""
    with log.open("w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({done.returncode}); {log}:\n"
                           + log.read_text()[-3000:])


def state_losses(output_dir: Path) -> dict[int, float]:
    """Per-step training losses from the Trainer's trainer_state.json (the newest one under output_dir)."""
    states = sorted(output_dir.rglob("trainer_state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        raise RuntimeError(f"no trainer_state.json under {output_dir}")
    history = json.loads(states[-1].read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


def largest_difference(ours: dict[int, float], theirs: dict[int, float]) -> tuple[float, int]:
    """max |ours - theirs| over the steps both have, and its step."""
    common = sorted(set(ours) & set(theirs))
    if not common:
        raise RuntimeError(f"no common steps: {sorted(ours)} against {sorted(theirs)}")
    return max((abs(ours[s] - theirs[s]), s) for s in common)


def report(job: Job, results: dict[str, dict[int, float]], checks: list[str]) -> bool:
    """Print a job's curves, its largest difference and checks; False when the difference is over the job's band."""
    for name, curve in results.items():
        print(f"{job.name:13s} {name:28s} " + " ".join(f"{step}:{loss:.7f}" for step, loss in sorted(curve.items())))
    if "zerodp" in results and "deepspeed" in results:
        diff, step = largest_difference(results["zerodp"], results["deepspeed"])
        print(f"{job.name:13s} max |zerodp - DeepSpeed| = {diff:.3e} at step {step} "
              f"over steps {min(results['zerodp'])}-{max(results['zerodp'])} (band {job.band:g})")
    for line in checks:
        print(f"{job.name:13s} {line}")
    sys.stdout.flush()
    return "deepspeed" not in results or diff <= job.band


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"of {','.join(JOBS)} (default: all)")
    parser.add_argument("--deepspeed-python", default=sys.executable,
                        help="an interpreter with a real DeepSpeed, transformers, trl, accelerate (default: this one)")
    parser.add_argument("--transformers-src", type=Path, help="a transformers checkout (for run_clm.py)")
    parser.add_argument("--deepspeed-examples", type=Path, help="a DeepSpeedExamples checkout (DeepSpeed-Chat)")
    parser.add_argument("--llamafactory-python", help="an interpreter where `pip install llamafactory` succeeded")
    parser.add_argument("--llamafactory-src", type=Path, help="a LLaMA-Factory checkout (its examples/deepspeed)")
    parser.add_argument("--work", type=Path, help="where runs write (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch (default 900)")
    args = parser.parse_args()
    args.transformers_src, args.deepspeed_examples, args.llamafactory_src = (
        p.resolve() if p else None for p in (args.transformers_src, args.deepspeed_examples, args.llamafactory_src))
    work = args.work or Path(tempfile.mkdtemp(prefix="zerodp-frameworks-"))
    inputs = make_inputs(work / "inputs", with_weights=True)
    failed = 0
    for name in args.jobs.split(","):
        job = JOBS[name]
        missing = job.missing(args)
        if missing:
            print(f"{name:13s} not run: {missing}")
            continue
        try:
            results, checks = job.run(args, inputs, work / name, environment, run)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            failed += 1
            print(f"{name:13s} FAILED: {str(error)[-2500:]}")
            continue
        failed += not report(job, results, checks)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
