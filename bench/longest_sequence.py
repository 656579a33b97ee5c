"""The longest sequence `zerodp estimate`'s simulation fits per GPU count, with and without Ulysses.

    python bench/longest_sequence.py                      # Llama-3.1-8B's shape, 80 GB GPUs (~15 min here)
    python bench/longest_sequence.py --rows 8:1,8:8 --gpu-memory 80e9

For each GPUS:S row: the longest multiple of 1024 tokens (one sequence, micro-batch 1) whose simulated
peak per rank stays within the usable memory (80 GB less the planner's 10% headroom: 72 GB), at ZeRO
stage 3 with the optimizer offloaded to the CPU, every block checkpointed, bf16
(zerodp/plan/estimate.py's `longest_trainable_sequence`: two simulations fix peak = fixed + per_token x L,
two more check the answer and one granule beyond). Prints a markdown table (docs/memory.md has it)
and writes bench/results/longest_sequence.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zerodp.plan.model_states import StrategySpec
from zerodp.plan.estimate import longest_trainable_sequence
from zerodp.plan.workload import workload

REPO = Path(__file__).resolve().parent.parent
ROWS = "8:8,32:32,8:1,1:1,32:8,16:8"
HEADROOM = 0.1  # zerodp plan's default: fragmentation and the CUDA context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "docs/models/llama-8b"))
    parser.add_argument("--rows", default=ROWS, help=f"GPUS:S,... (default {ROWS})")
    parser.add_argument("--gpu-memory", type=float, default=80e9, help="bytes per GPU (default 80e9)")
    args = parser.parse_args()
    work, budget = workload(args.model), int(args.gpu_memory * (1 - HEADROOM))
    strategy = StrategySpec(3, "cpu")
    results = []
    out = REPO / "bench/results/longest_sequence.json"
    out.parent.mkdir(exist_ok=True)
    print(f"| GPUs | S | longest sequence (tokens) | fixed (GB) | per token (kB) | peak at it (GB) | simulations | s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in args.rows.split(","):
        gpus, sp = (int(x) for x in row.split(":"))
        began = time.perf_counter()
        found = longest_trainable_sequence(work, strategy, gpus, sp, budget)
        seconds = time.perf_counter() - began
        results.append({"gpus": gpus, "sequence_parallel": sp, "seq_len": found.seq_len, "fixed_bytes": found.fixed_bytes,
                        "per_token_bytes": found.per_token_bytes, "peak_at": found.peak_at,
                        "peak_beyond": found.peak_beyond, "simulations": found.simulations, "seconds": seconds,
                        "budget_bytes": budget, "strategy": strategy.describe()})
        out.write_text(json.dumps(results, indent=1) + "\n")  # after every row: a long run keeps what it found
        print(f"| {gpus} | {sp} | {found.seq_len:,} | {found.fixed_bytes / 1e9:.2f} | {found.per_token_bytes / 1e3:.1f} | "
              f"{(found.peak_at or 0) / 1e9:.2f} | {found.simulations} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
