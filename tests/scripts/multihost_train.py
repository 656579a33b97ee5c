"""A small zerodp training job for the multi-host tests; nothing host-specific in it.

    zerodp run --nnodes 2 --node-rank R --master-addr A --master-port P --nproc-per-node 2 \\
        tests/scripts/multihost_train.py --stages 0,1,2,3 --steps 4 --ckpt DIR [--save-at 2] [--resume]

For each ZeRO stage in turn, trains tests/models.py's TiedMLP in fp32 on each rank's own batches (by
global rank) with 2 accumulation steps; with --save-at K saves a checkpoint under DIR/stageS after step
K (--node-local: into each host's own DIR); with --resume loads it first and trains the remaining steps. Prints one JSON line on global rank 0:
every rank's losses per stage (float32 values, exact in the float64 row gathered), the world size, and
the host each rank ran on.
"""

import argparse
import json
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402
from tests.models import batch, make_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--stages", default="3")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--save-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--node-local", action="store_true", help="checkpoint.use_node_local_storage")
args = parser.parse_args()


def train(stage: int) -> tuple[list[float], int]:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "checkpoint": {"use_node_local_storage": args.node_local}}
    engine, *_ = zerodp.initialize(model=make_model(), config=config)
    ckpt = os.path.join(args.ckpt, f"stage{stage}")
    if args.resume:
        engine.load_checkpoint(ckpt)
    losses = []
    for step in range(engine.global_steps, args.steps):
        for micro in range(2):
            loss = engine(*batch(dist.get_rank(), step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if args.save_at == step + 1:
            engine.save_checkpoint(ckpt)
    return losses, engine.global_steps


results = {stage: train(stage) for stage in map(int, args.stages.split(","))}
# every rank's losses and host through zerodp.comm (its collectives leave nothing for gloo's threads to
# release at interpreter exit; a last raw dist.all_gather_object here aborted a rank at exit in 1 of about
# 20 launches on this machine: gloo, torch #190489)
host = os.environ.get("ZERODP_TEST_HOST", "")  # tests/netns.py's namespace "<tag>-h<index>", if in one
tag, _, index = host.rpartition("-h")
row = torch.tensor([float(index) if host else -1.0] + [x for losses, _ in results.values() for x in losses],
                   dtype=torch.float64)
rows = zerodp.comm.all_gather_rows(row).tolist()
if dist.get_rank() == 0:
    losses, at = {}, 1
    for stage, (mine, _) in results.items():
        losses[stage] = [r[at : at + len(mine)] for r in rows]
        at += len(mine)
    print(json.dumps({"losses": losses, "world": dist.get_world_size(),
                      "hosts": [f"{tag}-h{int(r[0])}" if r[0] >= 0 else socket.gethostname() for r in rows],
                      "global_steps": {s: r[1] for s, r in results.items()}}))
