"""Generation under ZeRO-3: tokens/s with units kept gathered (GatheredParameters, engine.generation()),
against stage 2.

    python bench/generate_zero3.py [--tokens 32] [--nproc 2]

A tiny Llama built from a config (transformers, random weights) on 2 gloo ranks, in forward-only
engines (no optimizer), generates greedily with `model.generate` (the same prompt on every rank,
`synced_gpus=True`, no early stop). Rows: stage 2 (parameters whole on every rank); stage 3 as is
(every forward gathers every unit); stage 3 inside `with zerodp.zero.GatheredParameters(
model.parameters()):` (gathered once on entry); stage 3 inside `engine.generation()` (each unit kept
after its first gather, within stage3_max_live_parameters), and with a budget of half the model's
parameters. Rows run in --rounds interleaved rounds of fresh processes. Reports ms/token (the median
over rounds of the median of --repeats calls after one warm-up), the units' all-gathers
per generate() call (not the 16-byte rank checks gloo adds), tokens/s as a ratio to stage 2, and
whether the tokens equal stage 2's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(stage: int, mode: str, tokens: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerodp
    from zerodp import comm

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                                        "zero_optimization": zero})
    prompt = torch.arange(1, 9).unsqueeze(0)

    def gathers() -> int:  # the units' gathers, not the rank checks (int64)
        return sum(r.calls for (op, dtype), r in comm.ledger.current.items()
                   if op.startswith("all_gather") and dtype != "int64")

    def generate() -> tuple[list[int], float, int]:
        start, before = time.perf_counter(), gathers()
        out = engine.module.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                     synced_gpus=True, pad_token_id=0)
        return out[0].tolist(), time.perf_counter() - start, gathers() - before

    runs = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if mode == "held":
                with zerodp.zero.GatheredParameters(engine.module.parameters()):
                    runs.append(generate())
            elif mode.startswith("generation"):
                half = sum(p.ds_numel for p in model.parameters()) // 2 if mode == "generation-half" else None
                with engine.generation(max_live_parameters=half):
                    runs.append(generate())
            else:
                runs.append(generate())
    if dist.get_rank() == 0:
        print(json.dumps({"tokens": runs[-1][0], "ms_per_token": 1000 * statistics.median(r[1] for r in runs[1:]) / tokens,
                          "gathers": runs[-1][2]}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="generate() calls per launch (median)")
    parser.add_argument("--rounds", type=int, default=3, help="launches per row, interleaved (median)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.tokens, args.repeats)
        return 0
    rows = [(2, "plain", "stage 2"), (3, "plain", "stage 3"), (3, "held", "stage 3 inside GatheredParameters"),
            (3, "generation", "stage 3 inside engine.generation()"),
            (3, "generation-half", "stage 3 inside engine.generation(max_live_parameters=half the model)")]
    runs: dict[str, list[dict]] = {label: [] for _, _, label in rows}
    for round_ in range(args.rounds):  # interleaved, so a drift of the machine's speed hits every row alike
        for stage, mode, label in rows:
            print(f"round {round_ + 1}/{args.rounds}: {label} ...", file=sys.stderr, flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(args.nproc), __file__, "--worker", str(stage), mode, "--tokens", str(args.tokens),
                       "--repeats", str(args.repeats)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{label} failed:\n{(done.stdout + done.stderr)[-3000:]}")
            runs[label].append(json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"'))))
    ms = {label: statistics.median(r["ms_per_token"] for r in rs) for label, rs in runs.items()}
    base = runs["stage 2"][0]
    print(f"| engine ({args.nproc} ranks, {args.tokens} tokens) | ms/token (median of {args.rounds} rounds) | "
          "all-gathers per generate | tokens/s vs stage 2 | tokens equal stage 2's |")
    print("|---|---|---|---|---|")
    for label, rs in runs.items():
        print(f"| {label} | {ms[label]:.2f} | {rs[-1]['gathers']} | {ms['stage 2'] / ms[label]:.2f}x "
              f"| {all(r['tokens'] == base['tokens'] for r in rs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
