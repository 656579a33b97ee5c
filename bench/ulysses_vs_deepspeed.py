"""DeepSpeed's Ulysses recipe, one script, on zerodp (ZERODP_AS_DEEPSPEED=1) and on a real DeepSpeed.

    python bench/ulysses_vs_deepspeed.py --deepspeed-python /work/benchvenv/bin/python --stages 2,3

The script below is DeepSpeed's ALST recipe unchanged: `register_with_transformers` (sdpa, S = 2) ->
mpu, `UlyssesSPDataLoaderAdapter` over each rank's own batches, `deepspeed.initialize(mpu=mpu)`, the
sequence loss Hugging Face's Trainer builds (each rank backpropagates its token share of the mean),
`engine.backward` / `engine.step`. 2 ranks (gloo, CPU, DS_ACCELERATOR=cpu), a tiny Llama, fp32, SGD
(lr 0.1, momentum 0.9: its update is linear in the gradient, so a gradient scale shows in the losses),
4 micro-batches. Prints each framework's losses per stage.
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
import json, sys
import torch
import deepspeed
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from deepspeed.utils import groups
from transformers import LlamaConfig, LlamaForCausalLM

stage = int(sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64, attn_implementation="sdpa"))
mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
          "zero_allow_untested_optimizer": True,  # DeepSpeed's wording for a torch optimizer under ZeRO
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": stage}}
engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, model_parameters=model.parameters())
batches = []
for step in range(2):
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1000 * step + rank))
    batches.append({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(16).expand(2, 16)})
loader = UlyssesSPDataLoaderAdapter(batches, groups._get_sequence_parallel_rank(),
                                    groups._get_sequence_parallel_group(),
                                    groups._get_sequence_parallel_world_size(), torch.device("cpu"))
group = groups._get_sequence_parallel_group()
losses = []
for piece in loader:
    piece = {k: v.contiguous() for k, v in piece.items()}  # DeepSpeed's adapter leaves [:, a:b] slices of a
    # micro-batch > 1 strided, which HF's causal-LM loss cannot .view()
    out = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"], labels=piece["shift_labels"],
                 shift_labels=piece["shift_labels"])
    good = (piece["shift_labels"] != -100).sum()
    own = out.loss.float() * good
    totals = torch.stack((own.detach(), good.float()))
    torch.distributed.all_reduce(totals, group=group)
    loss = (own + (totals[0] - own.detach())) / totals[1]
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if rank == 0:
    print(json.dumps({"losses": losses}))
"""


def run(python: str, env: dict, stage: int) -> list[float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as job:
        job.write(_JOB)
    out = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", job.name,
                          str(stage)], capture_output=True, text=True, cwd=REPO, env={**os.environ, **env},
                         timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))["losses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", default="/work/benchvenv/bin/python")
    parser.add_argument("--stages", default="2,3")
    args = parser.parse_args()
    zerodp_env = {"ZERODP_AS_DEEPSPEED": "1", "PYTHONPATH": str(REPO)}
    deepspeed_env = {"DS_ACCELERATOR": "cpu", "ZERODP_AS_DEEPSPEED": "0"}
    for stage in (int(s) for s in args.stages.split(",")):
        ours, theirs = run(sys.executable, zerodp_env, stage), run(args.deepspeed_python, deepspeed_env, stage)
        print(f"stage {stage} zerodp    {' '.join(f'{x:.7f}' for x in ours)}")
        print(f"stage {stage} DeepSpeed {' '.join(f'{x:.7f}' for x in theirs)}")
        print(f"stage {stage} largest difference {max(abs(a - b) for a, b in zip(ours, theirs)):.2e}")


if __name__ == "__main__":
    main()
