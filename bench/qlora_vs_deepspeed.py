"""One QLoRA script on zerodp (ZERODP_AS_DEEPSPEED=1) and on a real DeepSpeed: losses and memory per rank.

    python bench/qlora_vs_deepspeed.py --deepspeed-python /work/benchvenv/bin/python --stages 2,3

The script below is what a user writes: a Llama (hidden 256, 4 layers, vocab 1024, saved in bf16) loaded with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)`
(bitsandbytes 0.50.2, its CPU backend), PEFT LoRA rank 8 on q_proj/v_proj, `deepspeed.initialize` with a bf16
config (torch's AdamW, lr 1e-3, stage3_param_persistence_threshold 0), 4 steps of micro-batch 2 x 64 tokens per
rank, 2 ranks (gloo, CPU, DS_ACCELERATOR=cpu). The same bitsandbytes, peft and transformers on both sides.

Memory, measured the same way for both after the last step, per rank, from the tensors each framework holds:
distinct storages of the parameters (`p.ds_tensor`, the rank's partition, where the framework partitions; else
the parameter), split into the 4-bit weights and the rest; the 4-bit weights' quantization states (absmax,
code maps: attributes of the weight, held whole by both); the innermost torch optimizer's parameters that are
not the model's (fp32 masters; DeepSpeed's stage 3 hands them to its torch optimizer only inside `step()`, so
there its own `fp32_partitioned_groups_flat`) and its state. zerodp's own ledger (`engine.memory_report()`) and
DeepSpeed's own flat buffers are printed beside. Gradients are left out: DeepSpeed frees or reuses its
gradient buffers around the step. The split of the parameters into 4-bit and rest is by storage: a storage
holding any 4-bit weight counts as 4-bit (zerodp's ledger splits its stage-3 shards exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_JOB = """
import json, os, sys
import torch
import deepspeed
import peft, transformers

stage, base = int(sys.argv[1]), sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).train()
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
          "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, config=config,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])
losses = []
for step in range(4):
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1000 * step + rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())

def storages(tensors):
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out

params = list(model.parameters())
held = lambda p: getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None else p.data
four_bit = storages(held(p) for p in params if getattr(p, "quant_state", None) is not None)
rest = {k: b for k, b in storages(held(p) for p in params if getattr(p, "quant_state", None) is None).items()
        if k not in four_bit}
states = []
for p in params:
    qs = getattr(p, "quant_state", None)
    while qs is not None:
        states += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
        qs = qs.state2
inner = engine.optimizer
while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
    inner = inner.optimizer
model_storages = {**four_bit, **rest}
masters = {k: b for k, b in storages(p for g in inner.param_groups for p in g["params"]).items()
           if k not in model_storages}
state = storages(v for s in inner.state.values() for v in s.values())
ledger = engine.memory_report()["held"] if hasattr(engine, "memory_report") else None
own = {}  # DeepSpeed's own flat buffers, where its ZeRO optimizer has them
for attr in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "bit16_groups_flat",
             "single_partition_of_fp32_groups"):
    found = getattr(engine.optimizer, attr, None)
    if isinstance(found, list) and not hasattr(engine, "memory_report"):
        own[attr] = sum(t.numel() * t.element_size() for t in found if isinstance(t, torch.Tensor))
if "fp32_partitioned_groups_flat" in own:  # stage 3 hands its torch optimizer the masters only inside step()
    masters = {"own": own["fp32_partitioned_groups_flat"]}
result = {"rank": rank, "losses": losses, "param4bit": sum(four_bit.values()), "params_other": sum(rest.values()),
          "quant_state": sum(storages(states).values()), "masters": sum(masters.values()),
          "optim_state": sum(state.values()), "ledger": ledger, "deepspeed_own": own}
torch.distributed.barrier()
print("RESULT " + json.dumps(result), flush=True)
"""


def _base(directory: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    path = os.path.join(directory, "base")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def run(python: str, env: dict, stage: int, base: str) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as job:
        job.write(_JOB)
    out = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", job.name,
                          str(stage), base], capture_output=True, text=True, cwd=REPO, env={**os.environ, **env},
                         timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


FRAMEWORKS = {"zerodp": {"ZERODP_AS_DEEPSPEED": "1", "PYTHONPATH": str(REPO)},
              "DeepSpeed": {"DS_ACCELERATOR": "cpu", "ZERODP_AS_DEEPSPEED": "0"}}
"""The environment each side runs in: zerodp answers `import deepspeed` in this venv; the real one in its own."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", default="/work/benchvenv/bin/python",
                        help="a Python with DeepSpeed, bitsandbytes, peft and transformers")
    parser.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages")
    args = parser.parse_args()
    keys = ("param4bit", "params_other", "quant_state", "masters", "optim_state")
    pythons = {"zerodp": sys.executable, "DeepSpeed": args.deepspeed_python}
    with tempfile.TemporaryDirectory() as tmp:
        base = _base(tmp)
        for stage in (int(s) for s in args.stages.split(",")):
            for name, env in FRAMEWORKS.items():
                python = pythons[name]
                for r in run(python, env, stage, base):
                    print(f"stage {stage} {name:<9} rank {r['rank']} losses {' '.join(f'{x:.6f}' for x in r['losses'])}")
                    print(f"stage {stage} {name:<9} rank {r['rank']} bytes " + " ".join(f"{k}={r[k]:,}" for k in keys))
                    if r["deepspeed_own"]:
                        print(f"stage {stage} {name:<9} rank {r['rank']} own flats " + json.dumps(r["deepspeed_own"]))
                    if r["ledger"] is not None:
                        print(f"stage {stage} {name:<9} rank {r['rank']} ledger " + json.dumps(r["ledger"]))


if __name__ == "__main__":
    main()
