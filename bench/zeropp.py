"""ZeRO++ quantized collectives: flat stage 3 against qwZ, qgZ, both, hpZ and all three; bytes per step on
each link from the comm ledger, and how far each loss curve strays from flat's.

    python bench/zeropp.py                      # 200 steps per mode, 4 ranks as 2 nodes of 2
    python bench/zeropp.py --steps 20 --blocks 256

Each mode trains the same demo GPT (zerodp.demo.TinyGPT: --d-model wide, 4 blocks, fp32 or --bf16, AdamW)
at ZeRO stage 3 on the same data (4 ranks on gloo, ranks 0-1 on node 0 and 2-3 on node 1 by torchrun's
GROUP_RANK, so the ledger tells intra-node bytes from inter-node ones). The data is learnable (each
sequence counts up by a fixed stride modulo the vocabulary), so the curves fall and their band means
something. The band of a mode is max over steps of |loss - flat loss|, the loss being the mean of the
4 ranks' micro-batch losses; the second band compares 20-step moving averages (the loss level, without
the step-to-step noise a perturbed trajectory shows where the loss falls fast). The block-size measurement runs qwZ + qgZ at each of --blocks (elements per
int8 block, one fp32 scale each) and reports the band, the bytes and the quantization error of the
initial weights (mean |w - deq(q(w))| / mean |w|). Results go to bench/results/zeropp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QW, QG, HPZ = {"zero_quantized_weights": True}, {"zero_quantized_gradients": True}, {"zero_hpz_partition_size": 2}
MODES = {"flat": {}, "hpz": HPZ, "qwz": QW, "qgz": QG, "qwz+qgz": {**QW, **QG}, "qwz+qgz+hpz": {**QW, **QG, **HPZ}}
VOCAB, SEQ, MICRO = 64, 32, 4
SMOOTH = 20  # steps of the moving average of the second band


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    stride = torch.randint(1, 4, (MICRO, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _train(rank: int, world: int, zero: dict, steps: int, d_model: int, bf16: bool, block: int) -> dict:
    os.environ["GROUP_RANK"] = str(rank // 2)
    import torch

    import zerodp
    from zerodp.demo import GPTConfig, TinyGPT
    from zerodp.zero import quantize

    quantize.BLOCK_NUMEL = block  # read when the engine is built
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=d_model, n_layer=4, n_head=4))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    q, scales = quantize.quantize(weights, block)
    error = float((weights - quantize.dequantize(q, scales, block)).abs().mean() / weights.abs().mean())
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    losses = []
    for step in range(steps):
        loss = engine(*_batch(rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.comm_report()["last_step"]
    return {"losses": losses, "link_bytes": report["link_bytes"], "params": sum(p.ds_numel for p in model.parameters()),
            "ops": {op: rec["bytes"] for op, rec in report["ops"].items()}, "weight_error": error}


def _run(zero: dict, args, block: int) -> dict:
    from tests.harness import run_ranks

    ranks = run_ranks(_train, 4, args=(zero, args.steps, args.d_model, args.bf16, block), timeout=3600)
    curve = [sum(r["losses"][t] for r in ranks) / len(ranks) for t in range(args.steps)]
    return {"curve": curve, "link_bytes": ranks[0]["link_bytes"], "ops": ranks[0]["ops"],
            "params": ranks[0]["params"], "weight_error": ranks[0]["weight_error"]}


def _band(curve: list[float], reference: list[float], window: int = 1) -> float:
    """max |curve - reference| over steps, both averaged over `window` steps (1: step by step)."""
    def smooth(c: list[float]) -> list[float]:
        return [sum(c[t : t + window]) / window for t in range(len(c) - window + 1)]
    return max(abs(a - b) for a, b in zip(smooth(curve), smooth(reference)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--bf16", action="store_true", help="bf16 working dtype (default fp32)")
    parser.add_argument("--blocks", default="64,256,2048", help="block sizes to measure with qwZ + qgZ")
    args = parser.parse_args()
    from zerodp.zero import quantize

    default_block = quantize.BLOCK_NUMEL
    results = {name: _run(zero, args, default_block) for name, zero in MODES.items()}
    flat = results["flat"]["curve"]
    print(f"{args.steps} steps, {results['flat']['params']:,} parameters, {'bf16' if args.bf16 else 'fp32'}, "
          f"4 ranks as 2 nodes, block {default_block}; loss flat {flat[0]:.4f} -> {flat[-1]:.4f}")
    print(f"{'mode':<14}{'intra-node B/step':>18}{'inter-node B/step':>18}{'total':>10}{'x less':>8}"
          f"{'band max|dloss|':>17}{f'band {SMOOTH}-step avg':>18}{'final loss':>11}")
    flat_total = sum(results["flat"]["link_bytes"].values())
    for name, r in results.items():
        total = sum(r["link_bytes"].values())
        r["band"], r["smooth_band"] = _band(r["curve"], flat), _band(r["curve"], flat, SMOOTH)
        print(f"{name:<14}{r['link_bytes']['intra_node']:>18,}{r['link_bytes']['inter_node']:>18,}{total:>10,}"
              f"{flat_total / total:>8.2f}{r['band']:>17.5f}{r['smooth_band']:>18.5f}{r['curve'][-1]:>11.4f}")
    print(f"\nblock size (qwZ + qgZ): {'block':>6}{'total B/step':>14}{'band max|dloss|':>17}"
          f"{f'band {SMOOTH}-step avg':>18}{'weight error':>14}")
    blocks = {}
    for block in (int(b) for b in args.blocks.split(",")):
        r = results["qwz+qgz"] if block == default_block else _run(MODES["qwz+qgz"], args, block)
        blocks[block] = {"total_bytes": sum(r["link_bytes"].values()), "band": _band(r["curve"], flat),
                         "smooth_band": _band(r["curve"], flat, SMOOTH), "weight_error": r["weight_error"]}
        print(f"{'':<24}{block:>6}{blocks[block]['total_bytes']:>14,}{blocks[block]['band']:>17.5f}"
              f"{blocks[block]['smooth_band']:>18.5f}{r['weight_error']:>14.5f}")
    out = REPO / "bench" / "results" / "zeropp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "modes": results, "blocks": blocks}, indent=1))


if __name__ == "__main__":
    main()
