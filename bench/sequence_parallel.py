"""Ulysses sequence parallelism on 4 ranks: activations per rank and all-to-all bytes per layer, from the ledger.

    python bench/sequence_parallel.py                       # S = 1, 2, 4; seq 1024; stage 3; fp32
    python bench/sequence_parallel.py --seq 2048 --sizes 1,4

Each S trains the same HF Llama (hidden 256, 8 heads, 2 key/value heads, 4 layers, sdpa) at ZeRO
stage 3 in 4 fresh processes (torchrun), 2 steps of one sequence per data-parallel replica. S = 1 is
plain data parallelism (each rank its own whole sequence); S = 4 cuts one sequence over the 4 ranks,
whose 2 key/value heads are each repeated to 2 ranks. Printed per S, for rank 0: what autograd saved
in the step (memory_report()["activations"]), the all-to-all bytes of the last step and per layer
against the formula 2 x 4 B x seq/S x head_dim x (2 x heads + 2 x max(kv_heads, S)) per layer
(forward and backward), and the median step time. Results go to bench/results/sequence_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 8, 2, 32, 256

_JOB = """
import json, statistics, sys, time
import torch
import zerodp, zerodp.sequence as sequence
from transformers import LlamaConfig, LlamaForCausalLM

sp_size, seq, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
zerodp.init_distributed()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=%(hidden)d, intermediate_size=4 * %(hidden)d,
                                     num_hidden_layers=%(layers)d, num_attention_heads=%(heads)d,
                                     num_key_value_heads=%(kv)d, head_dim=%(head_dim)d, max_position_embeddings=seq,
                                     attn_implementation="sdpa"))
if sp_size > 1:
    sequence.register_attention(model, "sdpa", sequence.initialize_sequence_parallel(sp_size))
config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": sp_size, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
engine, *_ = zerodp.initialize(model=model, config=config)
sp = sequence.current()
times = []
for step in range(steps):
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1000 * step + sp.dp_rank))
    piece = sequence.shard_batch({"input_ids": ids, "labels": ids}, sp.sp_rank, sp.sp_size)
    start = time.perf_counter()
    out = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"], labels=piece["shift_labels"],
                 shift_labels=piece["shift_labels"])
    loss = sequence.sequence_parallel_loss(out.loss, piece["shift_labels"], sp.sp_group) if sp_size > 1 else out.loss
    engine.backward(loss)
    engine.step()
    times.append(time.perf_counter() - start)
if torch.distributed.get_rank() == 0:
    a2a = engine.comm_report()["last_step"]["ops"].get("all_to_all[float32]", {"bytes": 0, "calls": 0})
    print(json.dumps({"sp": sp_size, "seq": seq, "activations_bytes": engine.memory_report()["activations"]["device"],
                      "all_to_all_bytes": a2a["bytes"], "all_to_all_calls": a2a["calls"],
                      "step_s": statistics.median(times), "loss": loss.item()}))
""" % {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv": KV_HEADS, "head_dim": HEAD_DIM}


def formula_bytes_per_layer(seq: int, sp: int) -> int:
    """All-to-all bytes one rank sends per layer per micro-batch (forward q, k, v, output; backward their
    gradients), fp32, micro-batch 1: zero without sequence parallelism."""
    if sp == 1:
        return 0
    return 2 * 4 * (seq // sp) * HEAD_DIM * (2 * HEADS + 2 * max(KV_HEADS, sp))


def run(sp: int, seq: int, steps: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as job:
        job.write(_JOB)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          job.name, str(sp), str(seq), str(steps)], capture_output=True, text=True, cwd=REPO,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows = [run(int(sp), args.seq, args.steps) for sp in args.sizes.split(",")]
    print(f"{'S':>2} {'activations/rank':>17} {'vs S=1':>7} {'all-to-all/step':>16} {'per layer':>10} "
          f"{'formula':>10} {'step s':>7}")
    base = rows[0]["activations_bytes"]
    for row in rows:
        per_layer = row["all_to_all_bytes"] // LAYERS
        print(f"{row['sp']:>2} {row['activations_bytes']:>17,} {row['activations_bytes'] / base:>7.3f} "
              f"{row['all_to_all_bytes']:>16,} {per_layer:>10,} {formula_bytes_per_layer(args.seq, row['sp']):>10,} "
              f"{row['step_s']:>7.2f}")
    results = REPO / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "sequence_parallel.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
