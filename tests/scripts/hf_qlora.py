"""QLoRA through the Hugging Face Trainer at ZeRO-3, as PEFT's docs run it; nothing zerodp-specific.

    zerodp run --nproc-per-node 2 tests/scripts/hf_qlora.py OUT_DIR

Run under ZERODP_AS_DEEPSPEED=1 (zerodp run sets it). A tiny Llama built from a config is saved in bf16, then
loaded with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=bfloat16)`
(the real bitsandbytes, its CPU backend), given PEFT LoRA adapters on every linear layer and fine-tuned by the
Trainer with a ZeRO-3 "auto" config: 4 steps straight, saved with save_model; 2 steps saving a checkpoint,
resumed to step 4. Rank 0 prints one JSON line: the losses, whether the resumed adapters equal the
uninterrupted ones bitwise, and whether the saved adapter holds the trained values and reloads with
PeftModel.from_pretrained onto a fresh 4-bit base.
"""

import json
import os
import sys

import deepspeed
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainerCallback, TrainingArguments)

out = sys.argv[1]
rank = int(os.environ["RANK"])
DS_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                          "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}
QUANT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16,
                           bnb_4bit_compute_dtype=torch.bfloat16)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


base = os.path.join(out, "tiny_llama")
if rank == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).to(torch.bfloat16).save_pretrained(base)
deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")
deepspeed.comm.barrier()


def arguments(name: str, max_steps: int) -> TrainingArguments:
    return TrainingArguments(output_dir=os.path.join(out, name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=1, max_steps=max_steps, learning_rate=1e-2, logging_steps=1,
                             save_strategy="steps", save_steps=2, report_to=[], bf16=True, deepspeed=DS_CONFIG,
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, lr_scheduler_type="constant")


def qlora_model() -> torch.nn.Module:
    torch.manual_seed(0)  # LoRA's random init: the same in each run of this process
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=QUANT, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


def run(name: str, max_steps: int, resume: str | None = None) -> tuple[Trainer, Losses]:
    losses = Losses()
    trainer = Trainer(model=qlora_model(), args=arguments(name, max_steps), train_dataset=Tokens(),
                      callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses


def adapters(trainer: Trainer) -> dict:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


straight, straight_losses = run("straight", 4)
expected = adapters(straight)
straight.save_model(os.path.join(out, "saved"))
run("first", 2)
resumed, resumed_losses = run("resumed", 4, resume=os.path.join(out, "first", "checkpoint-2"))
got = adapters(resumed)
if rank == 0:
    saved = load_file(os.path.join(out, "saved", "adapter_model.safetensors"))
    trained = {n.replace(".default", ""): t for n, t in expected.items()}
    matches = len(saved) == len(trained) > 0 and all(
        torch.equal(saved[n].float(), trained[n]) for n in saved)
    fresh = AutoModelForCausalLM.from_pretrained(base, quantization_config=QUANT, dtype=torch.bfloat16)
    reloaded = PeftModel.from_pretrained(fresh, os.path.join(out, "saved"))
    reloaded_ok = all(torch.equal(p.float(), expected[n]) for n, p in reloaded.named_parameters() if "lora_" in n)
    print(json.dumps({"losses": straight_losses.losses, "resumed_losses": resumed_losses.losses,
                      "resumed_bitwise": all(torch.equal(got[n], expected[n]) for n in expected),
                      "num_lora": len(expected), "saved_matches": matches, "reloaded_matches": reloaded_ok,
                      "lora_changed": any(n.endswith("lora_B.default.weight") and expected[n].abs().sum() > 0
                                          for n in expected)}))
