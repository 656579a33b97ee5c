"""DeepSpeed's GAN example loop, as a DeepSpeed user writes it: two engines, the generator's loss
through the discriminator's bare module, `netD.zero_grad()`; nothing zerodp-specific.

    zerodp deepspeed --num_gpus 2 tests/scripts/ds_gan.py --stage 2 --out OUT_DIR

Writes OUT_DIR/rank_R.json per rank: its losses (real, fake, generator per step).
"""

import argparse
import json
import os
import sys

import deepspeed
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.test_backward_paths import Discriminator, _bce, _gan_data  # noqa: E402 - the in-process test's model and data

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--out", required=True)
args = parser.parse_args()
deepspeed.init_distributed()
rank = deepspeed.comm.get_rank()
torch.manual_seed(0)
netD, netG = Discriminator(), nn.Sequential(nn.Linear(2, 4), nn.Tanh())
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": args.stage}}
model_engineD, *_ = deepspeed.initialize(model=netD, config=config,
                                         optimizer=torch.optim.Adam(netD.parameters(), lr=1e-2, foreach=True))
model_engineG, *_ = deepspeed.initialize(model=netG, config=config,
                                         optimizer=torch.optim.Adam(netG.parameters(), lr=1e-2, foreach=True))
losses = []
for step in range(3):
    real, noise = _gan_data(rank, step)
    netD.zero_grad()
    errD_real = _bce(netD(real), 1.0)
    model_engineD.backward(errD_real)
    fake = netG(noise)
    errD_fake = _bce(netD(fake.detach()), 0.0)
    model_engineD.backward(errD_fake)
    model_engineD.step()
    netG.zero_grad()
    errG = _bce(netD(fake), 1.0)
    model_engineG.backward(errG)
    model_engineG.step()
    losses += [errD_real.item(), errD_fake.item(), errG.item()]
with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:  # files: the ranks' stdout interleave
    json.dump({"rank": rank, "losses": losses}, f)
