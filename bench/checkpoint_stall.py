"""How long a checkpoint save stops training: sync against async saves (`checkpoint.async_save`),
on a checkpoint of >= 1 GB, with the disk's own write speed (`dd`) beside it.

    nice -n 10 python bench/checkpoint_stall.py            # 1 rank, ~102M fp32 params + Adam: 1.23 GB
    nice -n 10 python bench/checkpoint_stall.py --layers 4 # smaller and quicker (0.49 GB)

The stall is the wall time `engine.save_checkpoint` blocks the training loop. For an async save the
script then keeps training until the save is published (`latest` replaced at a step boundary) and
reports how long that took and the steps' time meanwhile (the writer thread shares the CPU, the GIL
and the disk with training). Write throughput: checkpoint bytes / sync save time, against
`dd if=/dev/zero of=DIR/dd.bin bs=1M count=1024 oflag=direct conv=fsync` in the same directory.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerodp  # noqa: E402


class Stack(nn.Module):
    """`layers` square Linear layers; the loss is the mean square of the output."""

    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def _step(engine, x: torch.Tensor) -> float:
    start = time.perf_counter()
    engine.backward(engine(x))
    engine.step()
    return time.perf_counter() - start


def _saves(engine, x: torch.Tensor, root: Path, mode: str, num_saves: int) -> list[dict]:
    rows = []
    for i in range(num_saves):
        _step(engine, x)
        start = time.perf_counter()
        engine.save_checkpoint(str(root / mode), tag=f"{mode}{i}", async_save=mode == "async")
        row = {"mode": mode, "stall_s": time.perf_counter() - start}
        if mode == "async":  # train on until the save is published, as a loop would
            steps = []
            while engine.async_saves.in_flight:
                steps.append(_step(engine, x))
            row.update(published_after_s=time.perf_counter() - start, steps_meanwhile=len(steps),
                       step_s_meanwhile=sum(steps) / max(1, len(steps)))
        rows.append(row)
    return rows


def _dd(directory: Path) -> float:
    """MB/s of dd writing 1 GiB with O_DIRECT and an fsync in `directory`."""
    target = directory / "dd.bin"
    done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=1024", "oflag=direct", "conv=fsync"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    match = re.search(r"copied, ([\d.]+) s", done.stderr)
    return 1024 * 1024 * 1024 / float(match[1]) / 1e6 if match else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=3200)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Stack(args.layers, args.dim)
    engine, *_ = zerodp.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randn(4, args.dim)
    root = Path(tempfile.mkdtemp(prefix="zerodp_stall_", dir=args.dir))
    try:
        for _ in range(2):
            _step(engine, x)  # warm-up: Adam's state exists from here on
        step_s = min(_step(engine, x) for _ in range(3))
        rows = _saves(engine, x, root, "sync", args.saves) + _saves(engine, x, root, "async", args.saves)
        checkpoint_bytes = sum(f.stat().st_size for f in (root / "sync" / "sync0").iterdir())
        dd_mb_s = _dd(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    sync = [r["stall_s"] for r in rows if r["mode"] == "sync"]
    result = {"params": params, "checkpoint_bytes": checkpoint_bytes, "step_s": step_s, "saves": rows,
              "sync_write_mb_s": checkpoint_bytes / min(sync) / 1e6, "dd_mb_s": dd_mb_s, "dir": args.dir}
    print(json.dumps(result, indent=1))
    print(f"\n{params / 1e6:.1f}M params, checkpoint {checkpoint_bytes / 1e9:.2f} GB, step {step_s:.2f} s")
    for r in rows:
        extra = (f", published after {r['published_after_s']:.1f} s, {r['steps_meanwhile']} steps meanwhile at "
                 f"{r['step_s_meanwhile']:.2f} s/step") if r["mode"] == "async" else ""
        print(f"{r['mode']:5s} stall {r['stall_s']:.2f} s{extra}")
    print(f"sync write {result['sync_write_mb_s']:.0f} MB/s; dd (O_DIRECT, fsync) {dd_mb_s:.0f} MB/s in {args.dir}")


if __name__ == "__main__":
    main()
