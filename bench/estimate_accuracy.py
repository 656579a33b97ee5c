"""The estimator's peak against real runs on this CPU: predicted vs measured peak per rank.

    python bench/estimate_accuracy.py                 # the whole matrix (two >= 100M models, ~25 min)
    python bench/estimate_accuracy.py --quick         # the demo's GPT at a small size (a minute)

For each case (a model, a stage, offload, activation checkpointing, dtype, ranks) the real run is a
torchrun job of fresh processes: every rank builds the model, `zerodp.initialize`s it and trains two
steps under `zerodp.plan.measure.AllocatorTrace`, which records what c10's CPU allocator hands out
and takes back (torch's profiler, `profile_memory=True`); "measured" is the most bytes live at once
after initialize. "Predicted" is `zerodp.plan.simulate.simulate_training` of the same rank on the CPU
(zerodp's engine on fake tensors and a fake process group): independent of the allocator's count.
The two peaks are compared per rank; results go to bench/results/estimate_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GPT = "gpt:vocab_size=32000,seq_len=256,d_model=768,n_layer=12,n_head=12"  # 110M parameters
LLAMA = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=512)  # 125M parameters, untied head
QUICK = "gpt:vocab_size=512,seq_len=128,d_model=256,n_layer=4,n_head=4"

CASES = [  # (stage, dtype, offload, activation checkpointing, ranks)
    (0, "fp32", "none", "none", 1),
    (1, "bf16", "none", "none", 2),
    (2, "bf16", "none", "blocks", 2),
    (2, "bf16", "cpu", "none", 2),
    (3, "bf16", "none", "none", 4),
    (3, "fp32", "none", "blocks", 2),
    (3, "bf16", "cpu", "selective", 2),
    (3, "bf16", "cpu", "blocks", 4),
]

_JOB = """
import json, sys
sys.path.insert(0, {repo!r})
import zerodp
from bench.estimate_accuracy import config_of, prepare_of
from zerodp.plan.workload import workload
from zerodp.plan.measure import measure_training

spec, case, micro_batch, seq_len, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
work = workload(spec)
peak, held = measure_training(work.build, config_of(*case[:3], micro_batch),
                              lambda m, device: work.inputs(m, micro_batch, seq_len, device), prepare=prepare_of(case[3]))
with open(f"{{out}}/rank{{zerodp.comm.get_rank()}}.json", "w") as f:
    json.dump({{"peak": peak, "held": held}}, f)
"""


def config_of(stage: int, dtype: str, offload: str, micro_batch: int) -> dict:
    from zerodp.plan.model_states import StrategySpec, strategy_config

    config = strategy_config(StrategySpec(stage, offload, offload if stage == 3 else "none", dtype), micro_batch)
    config["steps_per_print"] = 10**6
    return config


def prepare_of(policy: str):
    from zerodp import checkpointing

    return None if policy == "none" else \
        (lambda model: checkpointing.apply(model, "blocks", selective=policy == "selective"))


def measure(spec: str, case: tuple, micro_batch: int, seq_len: int) -> list[dict]:
    """One torchrun job of case[4] fresh ranks; each rank's measured peak and ledger."""
    with tempfile.TemporaryDirectory() as out:
        job = Path(out) / "job.py"
        job.write_text(_JOB.format(repo=str(REPO)))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={case[4]}", str(job), spec, json.dumps(case), str(micro_batch),
                               str(seq_len), out], capture_output=True, text=True, env={**_env(), "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"case {case} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(case[4])]


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}


def predict(spec: str, case: tuple, micro_batch: int, seq_len: int, rank: int):
    from zerodp.plan.workload import workload
    from zerodp.plan.simulate import simulate_training

    work = workload(spec)
    return simulate_training(work.build, config_of(*case[:3], micro_batch),
                             lambda m, device: work.inputs(m, micro_batch, seq_len, device), case[4], rank, "cpu",
                             prepare=prepare_of(case[3]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small model instead of the two >= 100M ones")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "estimate_accuracy.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = {"quick GPT": QUICK} if args.quick else {"TinyGPT 110M": GPT, "HF Llama 125M": _llama_dir(tmp)}
        rows = []
        for name, spec in models.items():
            for case in CASES:
                started = time.monotonic()
                try:
                    real = measure(spec, case, args.micro_batch, args.seq_len)
                except RuntimeError as err:  # reported, not fatal to the matrix
                    errors = [line for line in str(err).splitlines() if "Error" in line and "ChildFailed" not in line]
                    reason = (errors or str(err).strip().splitlines())[-1].split("]: ")[-1][:300]
                    rows.append({"model": name, "stage": case[0], "dtype": case[1], "offload": case[2],
                                 "activation_checkpointing": case[3], "ranks": case[4], "failed": reason})
                    print(f"{name:<14} stage {case[0]} {case[1]} offload {case[2]:<4} ckpt {case[3]:<9} {case[4]} ranks: "
                          f"the real run failed: {reason}", flush=True)
                    continue
                for rank, measured in enumerate(real):
                    sim = predict(spec, case, args.micro_batch, args.seq_len, rank)
                    predicted = sim.peak["total"].bytes
                    rows.append({"model": name, "stage": case[0], "dtype": case[1], "offload": case[2],
                                 "activation_checkpointing": case[3], "ranks": case[4], "rank": rank,
                                 "measured_bytes": measured["peak"], "predicted_bytes": predicted,
                                 "error": (predicted - measured["peak"]) / measured["peak"],
                                 "ledger_equal": sim.memory["held"] == measured["held"]})
                    r = rows[-1]
                    print(f"{name:<14} stage {case[0]} {case[1]} offload {case[2]:<4} ckpt {case[3]:<9} {case[4]} ranks, "
                          f"rank {rank}: measured {r['measured_bytes'] / 1e6:9.2f} MB, predicted "
                          f"{predicted / 1e6:9.2f} MB, {100 * r['error']:+.2f}%, ledger "
                          f"{'equal' if r['ledger_equal'] else 'DIFFERS'} ({time.monotonic() - started:.0f} s)",
                          flush=True)
    failed = [r for r in rows if "failed" in r]
    rows_ok = [r for r in rows if "failed" not in r]
    worst = max(rows_ok, key=lambda r: abs(r["error"]))
    print(f"{len(rows_ok)} rank-runs ({len(failed)} cases failed to run); largest error {100 * worst['error']:+.2f}% ({worst['model']}, stage {worst['stage']}, "
          f"{worst['dtype']}, offload {worst['offload']}, ckpt {worst['activation_checkpointing']}); within 2%: "
          f"{sum(abs(r['error']) <= 0.02 for r in rows_ok)}/{len(rows_ok)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"micro_batch": args.micro_batch, "seq_len": args.seq_len, "rows": rows},
                                         indent=1))


def _llama_dir(tmp: str) -> str:
    import transformers

    transformers.LlamaConfig(**LLAMA).save_pretrained(tmp)
    return tmp


if __name__ == "__main__":
    main()
