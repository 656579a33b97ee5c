"""A Hugging Face Trainer job with a DeepSpeed config full of "auto", as users write it; nothing zerodp-specific.

    zerodp run --nproc-per-node 2 tests/scripts/hf_trainer.py STAGE OUT_DIR

Run under ZERODP_AS_DEEPSPEED=1 (zerodp run sets it). A tiny GPT-2 built from a config is saved, then
loaded with `from_pretrained` (under zero.Init at stage 3, through transformers' own ZeRO-3 path) and
fine-tuned with PEFT LoRA in bf16 three times: 4 steps straight; 2 steps saving a checkpoint;
resumed from that checkpoint to step 4; then every weight for 2 steps. At stage 3 the untrained
model is first evaluated by a Trainer of its own (transformers evaluates before training at stage 3
only, on an engine without an optimizer). It prints one JSON line on rank 0: the losses, the
evaluation losses (and the untrained model's in plain torch), whether the resumed LoRA weights equal
the uninterrupted ones bitwise, and whether what save_model wrote (the adapter; the consolidated
full model) holds the trained weights.

(`evaluate()` and then `train()` on one Trainer fails at stage 3 with transformers 5.24 and
accelerate 1.15, on a real DeepSpeed too: the Trainer keeps the evaluation engine as its wrapped
model, so `train()` skips `accelerator.prepare` and `accelerator.backward` finds no engine.)
"""

import json
import os
import sys

import deepspeed
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

stage, out = int(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
DS_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


base = os.path.join(out, "tiny_gpt2")
if rank == 0:
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(base)
deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")  # real DeepSpeed's CPU default is ccl
deepspeed.comm.barrier()  # the base model is on disk for every rank


def plain_eval_loss() -> float:
    """The untrained model's evaluation loss from a Trainer without DeepSpeed (built before any DeepSpeed
    config exists, so the model is not under zero.Init), the model in bf16 as DeepSpeed's is."""
    model = AutoModelForCausalLM.from_pretrained(base).to(torch.bfloat16)
    args = TrainingArguments(output_dir=os.path.join(out, "plain"), report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, eval_dataset=Tokens()).evaluate()["eval_loss"]


untrained_loss = plain_eval_loss()


def arguments(name: str, max_steps: int) -> TrainingArguments:
    return TrainingArguments(output_dir=os.path.join(out, name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=1e-2, logging_steps=1,
                             save_strategy="steps", save_steps=2, report_to=[], bf16=True, deepspeed=DS_CONFIG,
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)


def model_to_train(lora: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)  # LoRA's random init: the same in each run of this process
    model = AutoModelForCausalLM.from_pretrained(base)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    return model


def run(name: str, max_steps: int, resume: str | None = None, lora: bool = True) -> tuple[Trainer, Losses]:
    losses = Losses()
    trainer = Trainer(model=model_to_train(lora), args=arguments(name, max_steps), train_dataset=Tokens(),
                      eval_dataset=Tokens(), callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses


def trained_weights(trainer: Trainer) -> dict:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


eval_before = Trainer(model=model_to_train(), args=arguments("eval_before", 1), eval_dataset=Tokens()).evaluate()[
    "eval_loss"] if stage == 3 else None
straight, straight_losses = run("straight", 4)
eval_loss = straight.evaluate()["eval_loss"]
expected = trained_weights(straight)
straight.save_model(os.path.join(out, "saved"))
run("first", 2)
resumed, resumed_losses = run("resumed", 4, resume=os.path.join(out, "first", "checkpoint-2"))
got = trained_weights(resumed)
full, _ = run("full", 2, lora=False)  # every weight trained: save_model writes the consolidated model
full_weights = trained_weights(full)
full.save_model(os.path.join(out, "saved_full"))
def _matches(saved: dict, trained: dict) -> bool:
    """Every trained weight is in the file (tied lm_head.weight is saved once, as wte), bitwise in bf16."""
    return all(torch.equal(saved[n].float(), t) for n, t in trained.items() if n in saved) and \
        set(trained) - set(saved) <= {"lm_head.weight"}


if rank == 0:
    # the adapter file as PeftModel.from_pretrained reads it (here read directly: from_pretrained on one rank
    # would build the model under zero.Init, whose collectives need every rank)
    saved_lora = {n.replace(".weight", ".default.weight"): t.float()
                  for n, t in load_file(os.path.join(out, "saved", "adapter_model.safetensors")).items()}
    print(json.dumps({
        "losses": straight_losses.losses, "resumed_losses": resumed_losses.losses, "eval_loss": eval_loss,
        "eval_before": eval_before, "untrained_loss": untrained_loss,
        "resumed_bitwise": sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected),
        "num_lora": len(expected), "saved": sorted(os.listdir(os.path.join(out, "saved"))),
        "saved_matches": sorted(saved_lora) == sorted(expected)
                         and all(torch.equal(saved_lora[n], expected[n]) for n in expected),
        "saved_full": sorted(os.listdir(os.path.join(out, "saved_full"))),
        "saved_full_matches": _matches(load_file(os.path.join(out, "saved_full", "model.safetensors")), full_weights),
    }))
