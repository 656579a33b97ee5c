"""TRL's GRPOTrainer (generation inside the loop, a reference model), on a DeepSpeed config, as users write it.

    zerodp run --nproc-per-node 2 tests/scripts/trl_grpo.py STAGE OUT_DIR            # on zerodp
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/scripts/trl_grpo.py STAGE OUT_DIR   # on DeepSpeed

The tiny Llama and tokenizer of trl_dpo.py; GRPOTrainer samples 4 completions per prompt from the
policy (at stage 3 inside `deepspeed.zero.GatheredParameters(model.parameters())`, TRL's
`unwrap_model_for_generation`), scores them with a reward function (the share of even-numbered words), and trains 3 steps in bf16 with a KL term against the reference model.
Prints one JSON line on rank 0: the logged loss, reward and KL per step.
"""

import json
import os
import sys

import deepspeed
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_dpo import DS_CONFIG, Logs, save_base  # noqa: E402  (the same model, tokenizer and config)

out = sys.argv[2]


def prompts(n: int = 16) -> Dataset:
    g = torch.Generator().manual_seed(2)
    starts = [int(torch.randint(0, 50, (1,), generator=g)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [" ".join(f"w{s + k}" for k in range(4)) for s in starts]})


def even_words(prompts, completions, **kwargs) -> list[float]:
    """The share of the completion's words that are even-numbered (w0, w2, ...): the policy learns to prefer them."""
    return [sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1)
            for c in completions]


class GRPOLogs(Logs):
    keys = ("loss", "reward", "kl")


base = os.path.join(out, "tiny_llama")
deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")  # DeepSpeed's CPU default: ccl
args = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, max_steps=3, learning_rate=5e-3, beta=0.1, logging_steps=1,
                  save_strategy="no", report_to=[], bf16=True, deepspeed=DS_CONFIG, use_cpu=True, seed=0,
                  data_seed=0, disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})
if args.process_index == 0:
    save_base(base)
args.distributed_state.wait_for_everyone()  # the base model is on disk for every rank

logs = GRPOLogs()
trainer = GRPOTrainer(model=base, reward_funcs=even_words, args=args, train_dataset=prompts(),
                      processing_class=PreTrainedTokenizerFast.from_pretrained(base), callbacks=[logs])
trainer.train()
if args.process_index == 0:
    print(json.dumps({"logs": logs.rows, "ref_model": type(trainer.ref_model).__module__}))
