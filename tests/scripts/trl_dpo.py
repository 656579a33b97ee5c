"""TRL's DPOTrainer with its reference model, on a DeepSpeed config, as users write it; nothing zerodp-specific.

    zerodp run --nproc-per-node 2 tests/scripts/trl_dpo.py STAGE OUT_DIR [moe|experts]      # on zerodp
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/scripts/trl_dpo.py STAGE OUT_DIR   # on DeepSpeed

A tiny Llama and a word-level tokenizer are built from configs and saved (no hub downloads); DPOTrainer
loads the policy from that directory and builds the reference model itself, which TRL hands to
`deepspeed.initialize` without an optimizer (sharded at stage 3, stage 0 otherwise). bf16, 4 steps.
Prints one JSON line on rank 0: the logged loss, rewards/chosen, rewards/margins per step, and what
the reference model became. `moe`: a tiny Qwen3-MoE policy (transformers' fused experts); `experts`:
tests/moe_hf.py's DeepSeek-style model (a ModuleList of expert modules, loaded through the Auto classes
like remote code), and every rank writes the experts its policy called per forward to
OUT_DIR/expert_calls_RANK.json.
"""

import json
import os
import sys

import deepspeed
import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          TrainerCallback)
from trl import DPOConfig, DPOTrainer

stage = int(sys.argv[1])
MOE = sys.argv[3:] == ["moe"]  # optional third argument: a Qwen3-MoE policy instead of the Llama
EXPERTS = sys.argv[3:] == ["experts"]  # or a per-expert-module MoE policy
if EXPERTS:
    from tests.moe_hf import TinyExpertsConfig, TinyExpertsForCausalLM, register

    register()
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
DS_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
}


def save_base(path: str) -> None:
    """A tiny Llama and its tokenizer, as a local model directory."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    common = dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if EXPERTS:  # 8 experts, top-2, skipped when no token routes to them
        TinyExpertsForCausalLM(TinyExpertsConfig(vocab_size=len(WORDS), pad_token_id=0, eos_token_id=1,
                                                 bos_token_id=1)).save_pretrained(path)
        return
    if MOE:  # a mixture-of-experts policy: 4 experts, top-1, so the ranks route differently
        Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                                           head_dim=16, **common)).save_pretrained(path)
        return
    LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(path)


def preferences(n: int = 16) -> Dataset:
    """Prompts of counting words; the chosen answer continues the count, the rejected one repeats."""
    g = torch.Generator().manual_seed(1)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        start = int(torch.randint(0, 50, (1,), generator=g))
        rows["prompt"].append(" ".join(f"w{start + k}" for k in range(4)))
        rows["chosen"].append(" ".join(f"w{start + k}" for k in range(4, 8)))
        rows["rejected"].append(" ".join([f"w{start}"] * 4))
    return Dataset.from_dict(rows)


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.rows = []

    keys = ("loss", "rewards/chosen", "rewards/margins")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append({k: float(logs[k]) for k in self.keys})


def main(out: str) -> None:
    base = os.path.join(out, "tiny_llama")
    deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")  # DeepSpeed's CPU default: ccl
    args = DPOConfig(output_dir=os.path.join(out, "dpo"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=4, learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[], bf16=True,
                     deepspeed=DS_CONFIG, use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, max_length=32,
                     model_init_kwargs={"dtype": torch.float32})
    if args.process_index == 0:
        save_base(base)
    args.distributed_state.wait_for_everyone()  # the base model is on disk for every rank
    logs = Logs()
    trainer = DPOTrainer(model=base, args=args, train_dataset=preferences(),
                         processing_class=PreTrainedTokenizerFast.from_pretrained(base), callbacks=[logs])
    trainer.train()
    if EXPERTS:
        with open(os.path.join(out, f"expert_calls_{args.process_index}.json"), "w") as f:
            json.dump(trainer.model.expert_calls(), f)
    if args.process_index == 0:
        print(json.dumps({"logs": logs.rows, "ref_model": type(trainer.ref_model).__module__,
                          "ref_forward_only": getattr(trainer.ref_model, "forward_only", None)}))


if __name__ == "__main__":
    main(sys.argv[2])
