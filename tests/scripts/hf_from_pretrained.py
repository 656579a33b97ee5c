"""transformers' own ZeRO-3 path: `from_pretrained` under zero.Init once `is_deepspeed_zero3_enabled()`.

    zerodp run --nproc-per-node 2 tests/scripts/hf_from_pretrained.py OUT_DIR

Tiny GPT-2 (tied embeddings) and Llama models built from configs are saved by rank 0, then every rank
loads them with `AutoModelForCausalLM.from_pretrained` while a ZeRO-3 `HfDeepSpeedConfig` is alive
(transformers 5 builds the model on the meta device and loads into deepspeed.zero.Init's partitions).
Prints one JSON line on rank 0: per model, whether every parameter is partitioned and, gathered, equal to
the saved weight bitwise, and whether the tie survived.
"""

import json
import os
import sys

import deepspeed
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

out = sys.argv[1]
rank = int(os.environ["RANK"])
deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")
models = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                                  max_position_embeddings=32)),
}
references = {}
for name, build in models.items():
    torch.manual_seed(0)
    references[name] = build().state_dict()
    if rank == 0:  # the same seed gives every rank the same reference; rank 0 writes it
        torch.manual_seed(0)
        build().save_pretrained(os.path.join(out, name))
deepspeed.comm.barrier()

keep_alive = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
report = {"zero3_enabled": is_deepspeed_zero3_enabled()}
for name in models:
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, name))
    params = dict(model.named_parameters())
    partitioned = all(hasattr(p, "ds_id") and p.ds_tensor is not None and p.numel() == 0 for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        equal = all(torch.equal(p.detach(), references[name][n]) for n, p in params.items())
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    report[name] = {"partitioned": partitioned, "equal": equal, "tied": tied, "num_params": len(params)}
if rank == 0:
    print(json.dumps(report))
