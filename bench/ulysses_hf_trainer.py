"""The Hugging Face Trainer with DeepSpeed's sequence parallelism (`ParallelismConfig(sp_backend="deepspeed",
sp_size=2)`), unchanged, on zerodp and on a real DeepSpeed:

    ZERODP_AS_DEEPSPEED=1 PYTHONPATH=$PWD python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/ulysses_hf_trainer.py 2
    DS_ACCELERATOR=cpu /work/benchvenv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/ulysses_hf_trainer.py 2

The argument is the ZeRO stage. A tiny Llama (sdpa, fp32, CPU), 4 steps of one 16-token sequence per
sequence-parallel group, AdamW, gradient clipping "auto"; rank 0 prints the Trainer's losses, the log
lines carry the gradient norms. docs/long_sequences.md has the figures.
"""

import json
import os
import sys

import deepspeed
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

stage = int(sys.argv[1])
# DeepSpeed's Ulysses asserts that deepspeed.comm is up, which accelerate does not start on the CPU
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64, attn_implementation="sdpa"))
rows = []
for i in range(8):
    ids = torch.randint(1, 64, (16,), generator=torch.Generator().manual_seed(i)).tolist()
    rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(16))})
ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "zero_optimization": {"stage": stage}, "gradient_clipping": "auto"}
sequence_parallel = ParallelismConfig(sp_backend="deepspeed", sp_size=2,
                                      sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
args = TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ulysses_hf_trainer"),
                         per_device_train_batch_size=1, max_steps=4, learning_rate=1e-2, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, deepspeed=ds_config, parallelism_config=sequence_parallel,
                         seed=0)
trainer = Trainer(model=model, args=args, train_dataset=rows)
trainer.train()
if int(os.environ["RANK"]) == 0:
    print(json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]))
