"""What gathering a mixture-of-experts block whole costs at stage 3: bytes all-gathered per step (from
the comm ledger) and step time, whole-block units against per-expert units.

    python bench/moe_units.py [--steps 6] [--tokens 4,64]

A DeepSeek-style model (tests/moe_models.py: 4 layers, each a gate + 8 expert MLPs (top-2) + a shared
expert, 3.7M parameters) on 2 gloo ranks, fp32. Per-expert units only run when every rank routes the
same way, so both ranks get the same batch here (with different batches per rank they diverge: see
tests/test_moe.py). Three unit choices:
- "layers (default)": zerodp's default, each decoder layer one unit with its MoE block inside;
- "MoE blocks": `"leaf_module": {"classes": ["DeepseekStyleMoE"]}`, the block one unit, the rest in the root;
- "per expert": `"leaf_module": {"classes": ["ExpertMLP"]}`, each expert one unit, the rest in the root;
- "per expert, no prefetch": the same with `stage3_prefetch_bucket_size: 0`.
An expert no token reaches is not called, so with per-expert units it is not gathered in that pass,
unless the prefetch (which follows the order recorded in the previous step) fetched it ahead; the fewer
tokens per micro-batch, the more experts stay idle. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import run_ranks  # noqa: E402
from tests.moe_models import MoEShape  # noqa: E402

SHAPE = MoEShape(vocab=256, dim=128, hidden=256, num_experts=8, top_k=2, num_layers=4)
CHOICES = {"layers (default)": {}, "MoE blocks": {"leaf_module": {"classes": ["DeepseekStyleMoE"]}},
           "per expert": {"leaf_module": {"classes": ["ExpertMLP"]}},
           "per expert, no prefetch": {"leaf_module": {"classes": ["ExpertMLP"]}, "stage3_prefetch_bucket_size": 0}}


def _run(rank: int, world: int, zero: dict, tokens: int, steps: int) -> dict:
    import torch

    import zerodp
    from tests.moe_models import TinyMoELM

    model = TinyMoELM(shape=SHAPE)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerodp.initialize(model=model, config=config, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3))
    gathered, times = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: the same routing
        ids = torch.randint(0, SHAPE.vocab, (1, tokens), generator=g)
        start = time.perf_counter()
        loss = engine(ids, torch.roll(ids, -1, dims=1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        ops = engine.comm_report()["last_step"]["ops"]
        gathered.append(sum(r["bytes"] for op, r in ops.items() if op.startswith("all_gather") and "float" in op))
    experts_called = sum(len(c) for layer in model.expert_calls() for c in layer[-1:])
    return {"gathered_bytes": gathered[-1], "step_s": min(times[1:]),
            "units": len(engine.strategy.units), "experts_called": experts_called}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tokens", default="4,64", help="tokens per micro-batch, comma-separated")
    args = parser.parse_args()
    print("| tokens | units | units (count) | experts called (last step, of 32) | all-gathered MiB per step | "
          "step ms (fastest) |")
    print("|---|---|---|---|---|---|")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for label, zero in CHOICES.items():
            result = run_ranks(_run, 2, args=(zero, tokens, args.steps), timeout=600)[0]
            print(f"| {tokens} | {label} | {result['units']} | {result['experts_called']} | "
                  f"{result['gathered_bytes'] / 2**20:.2f} | {1000 * result['step_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
