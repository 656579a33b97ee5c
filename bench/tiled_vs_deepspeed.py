"""zerodp's ALST tiled compute against DeepSpeed 0.19.8's on the same inputs (no engine, plain torch).

    DS_ACCELERATOR=cpu /path/to/venv-with-deepspeed/bin/python bench/tiled_vs_deepspeed.py

The same tiny Hugging Face Llama MLP and LM head + cross-entropy as tests/test_sequence_tiled.py
(14 tokens in 3 shards, batch 2), each tiled computation called with DeepSpeed's signature from
`deepspeed.runtime.sequence_parallel.ulysses_sp` and from `zerodp.sequence`, the backward fed an
incoming gradient of 3 (what an engine's loss scaling or 1 / gradient accumulation steps does).
Prints the largest difference of each output and gradient from the untiled computation, per framework.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_sequence_tiled import (BATCH, IGNORE, SEQ, SHARDS, _loss_parts, _mlp, _mlp_forward,  # noqa: E402
                                       _token_loss_sum)

SCALE = 3.0


def _grads(module, x, out) -> dict:
    (out * SCALE).backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape) if out.dim() else None)
    return {"output": out.detach(), "input grad": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def _mlp_run(api, how: str) -> dict:
    mlp = _mlp()
    x = torch.randn(BATCH, SEQ, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(1)).requires_grad_()
    params = list(mlp.parameters())
    if how == "untiled":
        out = _mlp_forward(mlp, x)
    elif how == "TiledMLP":
        out = api.TiledMLP.apply(_mlp_forward, mlp, x, SHARDS, params)
    else:
        out = api.sequence_tiled_compute(_mlp_forward, SEQ, SHARDS, {"x": x}, {"self": mlp}, "x", params,
                                         output_unshard_dimension=1, output_reduction=None)
    return _grads(mlp, x, out)


def _loss_run(api, how: str) -> dict:
    head, x, y = _loss_parts()
    x = x.clone().requires_grad_()
    if how == "untiled":
        total = _token_loss_sum(head, x, y)
    else:
        total = api.TiledFusedLogitsLoss.apply(_token_loss_sum, head, x, y, None, SHARDS, [head.weight], "sum")
    return _grads(head, x, total / (y != IGNORE).sum())


def main() -> None:
    import deepspeed.runtime.sequence_parallel.ulysses_sp as deepspeed_api

    import zerodp.sequence as zerodp_api

    print("| computation | framework | " + " | ".join(["output", "input grad", "weights' grads (largest)"]) + " |")
    print("|---|---|---|---|---|")
    for how, run in (("TiledMLP", _mlp_run), ("sequence_tiled_compute", _mlp_run), ("TiledFusedLogitsLoss", _loss_run)):
        want = run(None, "untiled")
        for name, api in (("zerodp", zerodp_api), ("DeepSpeed 0.19.8", deepspeed_api)):
            got = run(api, how)
            diff = {k: (got[k] - want[k]).abs().max().item() / max(want[k].abs().max().item(), 1e-30) for k in want}
            weights = max(v for k, v in diff.items() if k not in ("output", "input grad"))
            print(f"| {how} | {name} | {diff['output']:.1e} | {diff['input grad']:.1e} | {weights:.1e} |")
    print("\n(each: largest |tiled - untiled| / largest |untiled| of that tensor)")


if __name__ == "__main__":
    main()
