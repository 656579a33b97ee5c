"""Move a run from DeepSpeed to zerodp mid-training: does it continue as DeepSpeed would have?

    pip install -c constraints/cpu.txt -e '.[test,bench]'       # bench pulls deepspeed
    python bench/from_deepspeed.py [--steps 6] [--precisions fp32,bf16]

Real DeepSpeed (2 ranks, gloo, DS_ACCELERATOR=cpu) trains the DeepSpeed fixture model
(tests/fixtures/deepspeed/model.py) at ZeRO stage 2 and 3 for --steps steps with a checkpoint
halfway. zerodp then loads that DeepSpeed checkpoint (engine.load_checkpoint on DeepSpeed's
directory) at 1 and 2 ranks and stages 1-3 and trains the second half on the same global batches.
The table gives, per run, the second half's losses and the largest difference from DeepSpeed's own
uninterrupted run, in the losses and in the final fp32 masters. A control row trains zerodp from
the same initial weights without any checkpoint: where its difference from DeepSpeed equals the
loaded runs', the gap is the two engines' arithmetic (bf16 rounding), not the load.
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
GLOBAL_BATCH = 8


def batch(step: int, rank: int, world: int):
    import torch

    x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(1000 + step))
    per_rank = GLOBAL_BATCH // world
    return x[rank * per_rank : (rank + 1) * per_rank]


def config(stage: int, precision: str, world: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 4}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, steps: range, rank: int, world: int, dtype) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(batch(step, rank, world).to(dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        import torch.distributed as dist

        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def masters(engine, framework: str) -> dict:
    if framework == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).flatten().tolist() for n, p in engine.module.named_parameters()
                if p.requires_grad}
    sys.path.insert(0, str(REPO))
    from tests.harness import full_state

    return {n: t["master"].tolist() for n, t in full_state(engine).items()}


def worker(framework: str, stage: int, precision: str, steps: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "tests" / "fixtures" / "deepspeed"))
    from model import Model, param_groups

    library = __import__("deepspeed" if framework == "deepspeed" else "zerodp")
    if framework == "deepspeed":
        library.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = Model()
    engine, *_ = library.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=0.01),
                                    config=config(stage, precision, world))
    half = steps // 2
    if framework == "deepspeed":
        train(engine, range(half), rank, world, dtype)
        engine.save_checkpoint(ckpt, tag="half")
    elif ckpt == "-":  # the control: zerodp from the start, no checkpoint
        train(engine, range(half), rank, world, dtype)
    else:
        engine.load_checkpoint(ckpt, tag="half")
    losses = train(engine, range(half, steps), rank, world, dtype)
    final = masters(engine, framework)
    if rank == 0:
        print(json.dumps({"losses": losses, "masters": final}))
    dist.destroy_process_group()


def run(framework: str, world: int, stage: int, precision: str, steps: int, ckpt: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--worker", framework, str(stage), precision, str(steps), str(ckpt or "-")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{framework} world {world} stage {stage} {precision} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"')))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        framework, stage, precision, steps, ckpt = args.worker
        worker(framework, int(stage), precision, int(steps), ckpt)
        return 0
    print("| saved by DeepSpeed | loaded by | losses after the load | largest loss difference | largest master difference |")
    print("|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        for ds_stage in (2, 3):
            with tempfile.TemporaryDirectory() as tmp:
                reference = run("deepspeed", 2, ds_stage, precision, args.steps, Path(tmp))
                print(f"| stage {ds_stage} {precision}, 2 ranks | DeepSpeed (uninterrupted) | "
                      f"{', '.join(f'{x:.7f}' for x in reference['losses'])} | | |")
                runs = [(2, ds_stage, None, f"zerodp stage {ds_stage}, 2 ranks, no checkpoint (control)")]
                runs += [(world, stage, Path(tmp), f"zerodp stage {stage}, {world} rank{'s' if world > 1 else ''}")
                         for world in (1, 2) for stage in (1, 2, 3)]
                for world, stage, ckpt, label in runs:
                    got = run("zerodp", world, stage, precision, args.steps, ckpt)
                    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
                    master_diff = max(abs(a - b) for n in reference["masters"]
                                      for a, b in zip(got["masters"][n], reference["masters"][n]))
                    print(f"| | {label} | {', '.join(f'{x:.7f}' for x in got['losses'])} | {loss_diff:.1e} "
                          f"| {master_diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
