"""An elastic zerodp job for the multi-host tests: whatever the world size, it resumes and finishes.

    zerodp run --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint HOST0:PORT ... \\
        tests/scripts/elastic_train.py --ckpt DIR --steps 8 [--step-sleep 0.3] [--tag TAG --no-save]

Stage 3, train_batch_size 16 at micro-batch 4: accumulation 1 at 4 ranks, 2 at 2 ranks (derived by
`initialize` from the world size of each start). Loads DIR's latest checkpoint (or TAG) if there is
one, trains to --steps optimizer steps, saving after every step (unless --no-save). Prints one JSON
line on rank 0: the world size, torchrun's restart count, the tag it resumed from, the global steps
reached and every rank's losses of this start.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402
from tests.models import batch, make_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step: time for a host to die")
parser.add_argument("--tag", default=None)
parser.add_argument("--no-save", action="store_true")
args = parser.parse_args()

config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = zerodp.initialize(model=make_model(), config=config)
path, _ = engine.load_checkpoint(args.ckpt, tag=args.tag)
losses = []
while engine.global_steps < args.steps:
    step = engine.global_steps
    for micro in range(engine.gradient_accumulation_steps()):
        loss = engine(*batch(dist.get_rank(), step, micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if not args.no_save:
        engine.save_checkpoint(args.ckpt)
    time.sleep(args.step_sleep)
rows = zerodp.comm.all_gather_rows(torch.tensor(losses, dtype=torch.float64)).tolist()
if dist.get_rank() == 0:
    print(json.dumps({"world": dist.get_world_size(), "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                      "resumed_from": Path(path).name if path else None, "global_steps": engine.global_steps,
                      "accumulation": engine.gradient_accumulation_steps(), "losses": rows}))
