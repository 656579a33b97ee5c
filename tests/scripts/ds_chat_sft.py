"""A DeepSpeed-Chat-style SFT loop, written against DeepSpeed's API only; nothing zerodp-specific.

    zerodp deepspeed --num_gpus 2 tests/scripts/ds_chat_sft.py --out DIR [--offload] [--zero_stage 3] [--resume]

The patterns DeepSpeed-Chat's step-1 training uses: `--local_rank` from the launcher, a config dict built
in the script with `offload_param` set whenever --offload is (at every stage), DeepSpeedCPUAdam or
FusedAdam with decay / no-decay groups, a tiny Hugging Face model from a config, `engine.backward` /
`engine.step`, `save_checkpoint`, and its saving at the end: `save_hf_format` (rank 0 alone calls
`model.state_dict()`) then, at stage 3, `save_zero_three_model` (every rank gathers each parameter that
has `ds_id` and is NOT_AVAILABLE, rank 0 keeps it). With --resume it loads the checkpoint a first run
saved (a relaunch) and trains --steps more. Prints one JSON line on rank 0.
"""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--offload", action="store_true")
parser.add_argument("--zero_stage", type=int, default=3)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
if args.local_rank == -1:
    raise SystemExit("launch with a DeepSpeed-style launcher: it passes --local_rank")
get_accelerator().set_device(args.local_rank)
deepspeed.init_distributed()
rank = deepspeed.comm.get_rank()

device = "cpu" if args.offload else "none"
ds_config = {  # DeepSpeed-Chat's get_train_ds_config, shrunk
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
    "zero_optimization": {"stage": args.zero_stage, "offload_param": {"device": device},
                          "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
}
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
no_decay = ["bias", "ln_"]
groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.1},
          {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0}]
adam = DeepSpeedCPUAdam if args.offload else FusedAdam
optimizer = adam(groups, lr=1e-3, betas=(0.9, 0.95))
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=True)
ckpt = os.path.join(args.out, "ckpt")
if args.resume:
    engine.load_checkpoint(ckpt)


def micro_batch(step: int, micro: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


losses = []
first = engine.global_steps
for step in range(first, first + args.steps):
    for micro in range(engine.gradient_accumulation_steps()):
        ids = micro_batch(step, micro)
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
engine.tput_timer.update_epoch_count()  # DeepSpeed-Chat's step 1 ends each epoch with it
if not args.resume:
    engine.save_checkpoint(ckpt)

# save_hf_format: rank 0 only, state_dict of the module
if rank == 0:
    placeholders = {k: tuple(v.shape) for k, v in engine.module.state_dict().items()}
# save_zero_three_model: every rank gathers what is partitioned, rank 0 keeps it
full = {}
for name, p in engine.module.named_parameters():
    if hasattr(p, "ds_id"):
        fetch = [p] if p.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(fetch, enabled=args.zero_stage == 3):
            value = p.data.cpu().clone()
    else:
        value = p.cpu().clone()
    if rank == 0:
        full[name] = value
if rank == 0:
    print(json.dumps({"losses": losses, "global_steps": engine.global_steps, "full_shapes_ok":
                      all(tuple(full[n].shape) == tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                          for n, p in engine.module.named_parameters()),
                      "num_placeholders": sum(s == (0,) for s in placeholders.values()),
                      "epochs": engine.tput_timer.epoch_count,
                      "optimizer": type(engine.optimizer).__name__}))
