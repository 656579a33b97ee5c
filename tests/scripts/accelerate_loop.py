"""An accelerate training loop, as users write it; nothing zerodp-specific.

    ZERODP_AS_DEEPSPEED=1 accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 \\
        --mixed_precision bf16 --zero3_save_16bit_model true tests/scripts/accelerate_loop.py OUT_DIR

A tiny GPT-2 trains 2 steps, `save_state`, 2 more steps; `load_state` goes back and the same 2 batches
must give the same losses bitwise; `get_state_dict` must hold the trained weights. One JSON line on rank 0.
"""

import json
import os
import sys

import deepspeed
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from transformers import GPT2Config, GPT2LMHeadModel

out = sys.argv[1]
# Without an accelerator, accelerate picks no process-group backend for DeepSpeed (real or zerodp's): name it.
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i)) for i in range(16)]
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = list(loader)


def train(steps: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in steps:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


train(batches[:2])
accelerator.save_state(os.path.join(out, "state"))
after_save = train(batches[2:4])
accelerator.load_state(os.path.join(out, "state"))
after_load = train(batches[2:4])
state = accelerator.get_state_dict(model)  # every rank takes part; the full weights land on rank 0
params = list(model.parameters())
with deepspeed.zero.GatheredParameters(params):
    trained = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
if accelerator.is_main_process:
    print(json.dumps({
        "engine": type(model).__module__, "after_save": after_save, "after_load": after_load,
        "state_keys": len(state), "state_matches": all(torch.equal(state[n], t) for n, t in trained.items()),
        "saved": sorted(os.listdir(os.path.join(out, "state"))),
    }))
