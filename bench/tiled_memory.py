"""What ALST's tiling saves: activation bytes autograd keeps for backward (zerodp's memory ledger,
`engine.memory_report()["activations"]`) with and without TiledMLP and the tiled loss.

    python bench/tiled_memory.py [--seq 2048] [--vocab 16384] [--steps 3]

A Hugging Face Llama (hidden 256, MLP 1024, 2 layers, 4 heads, sdpa, fp32) on one CPU rank, stage 0,
batch 1; the loss is the sum of token losses over the labelled tokens. Three runs:
- untiled: LlamaMLP and the head + cross-entropy as they are;
- TiledMLP: each layer's MLP through `TiledMLP.apply` in ceil(seq / hidden) shards (ALST's rule);
- TiledMLP + tiled loss: also the head and loss through `TiledFusedLogitsLoss` in 8 shards.
Prints a markdown table: the ledger's saved activations per micro-batch (the peak between forward and
backward; a tiled computation adds one shard's recomputed activations during its own backward, freed
before the next shard's) and the fastest step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import run_ranks  # noqa: E402

HIDDEN, MLP, LAYERS, HEADS, LOSS_SHARDS = 256, 1024, 2, 4, 8


def _build(vocab: int, mode: str):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerodp.sequence import TiledFusedLogitsLoss, TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp(self, x):
        return TiledMLP.apply(mlp_forward, self, x, math.ceil(x.shape[1] / HIDDEN), None)

    def token_losses(head, x, y):
        return F.cross_entropy(head(x).view(-1, vocab), y.reshape(-1), ignore_index=-100, reduction="sum")

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=MLP,
                                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                   max_position_embeddings=1 << 16, attn_implementation="sdpa"))
            if mode != "untiled":
                for layer in self.lm.model.layers:
                    layer.mlp.forward = types.MethodType(tiled_mlp, layer.mlp)

        def forward(self, ids, labels):
            hidden = self.lm.model(input_ids=ids).last_hidden_state
            head = self.lm.lm_head
            if mode == "TiledMLP + tiled loss":
                total = TiledFusedLogitsLoss.apply(token_losses, head, hidden, labels, None, LOSS_SHARDS, None, "sum")
            else:
                total = token_losses(head, hidden, labels)
            return total / (labels != -100).sum()

    return WithLoss()


def _run(rank: int, world: int, mode: str, seq: int, vocab: int, steps: int) -> dict:
    import torch

    import zerodp

    model = _build(vocab, mode)
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                        "zero_optimization": {"stage": 0},
                                                        "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    times, losses = [], []
    for step in range(steps):
        ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        loss = engine(ids, torch.roll(ids, -1, dims=1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"activations": engine.memory_report()["activations"], "step_s": min(times), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print("| run | saved activations per micro-batch (MiB) | fastest step (s) | losses |")
    print("|---|---|---|---|")
    for mode in ("untiled", "TiledMLP", "TiledMLP + tiled loss"):
        result = run_ranks(_run, 1, args=(mode, args.seq, args.vocab, args.steps), timeout=1200)[0]
        saved = sum(result["activations"].values())
        losses = ", ".join(f"{x:.6f}" for x in result["losses"])
        print(f"| {mode} | {saved / 2**20:.1f} | {result['step_s']:.2f} | {losses} |", flush=True)


if __name__ == "__main__":
    main()
