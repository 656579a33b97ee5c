"""Checkpoint save / load / convert throughput and peak memory on a checkpoint of >= 1 GB.

    python bench/checkpoint_io.py                 # 109M-param GPT, saved at 2 ranks stage 2, loaded at
                                                  # 1 rank stage 1, converted to safetensors and to .bin

Each phase runs in fresh processes; peak RSS is each process's ru_maxrss, reported next to the
same process's RSS just before the phase (the baseline: torch, the model, the optimizer state).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp.demo import GPTConfig, TinyGPT  # noqa: E402

MODEL = GPTConfig(vocab_size=32768, seq_len=64, d_model=1024, n_layer=6, n_head=16)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine(stage: int):
    import zerodp

    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    return engine, sum(p.numel() for p in model.parameters())


def _worker(rank: int, world: int, port: int, phase: str, stage: int, root: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine, numel = _engine(stage)
    idx = torch.randint(0, MODEL.vocab_size, (1, MODEL.seq_len))
    if phase == "save":
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
    before = _rss_mib()
    dist.barrier()
    start = time.perf_counter()
    if phase == "save":
        engine.save_checkpoint(root, tag="bench")
    else:
        engine.load_checkpoint(root, tag="bench")
    dist.barrier()
    out.put((rank, {"seconds": time.perf_counter() - start, "rss_before_mib": before, "peak_mib": _peak_mib(),
                    "numel": numel}))
    dist.destroy_process_group()


def _phase(phase: str, world: int, stage: int, root: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, phase, stage, root, queue), nprocs=world, start_method="spawn")
    return [r for _, r in sorted(queue.get() for _ in range(world))]


def _convert(how: str, root: str, out: str) -> dict:
    code = ("import resource,time,sys; sys.path.insert(0, %r); import torch, zerodp.checkpoint as c; "
            "b=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; t=time.perf_counter(); "
            "c.%s(%r, %r, tag='bench', max_shard_bytes=2**28); "
            "print(time.perf_counter()-t, b/1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)"
            % (str(Path(__file__).resolve().parents[1]), how, root, out))
    seconds, before, peak = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                       check=True).stdout.split())
    return {"seconds": seconds, "rss_before_mib": before, "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="zerodp-ckpt-bench-")
    try:
        ckpt = os.path.join(root, "ckpt")  # the exports go beside it: an output inside it is refused
        saved = _phase("save", 2, 2, ckpt)
        size = sum(f.stat().st_size for f in Path(ckpt, "bench").iterdir())
        loaded = _phase("load", 1, 1, ckpt)
        safetensors = _convert("convert_to_safetensors", ckpt, os.path.join(root, "hf"))
        torch_bin = _convert("convert_to_torch", ckpt, os.path.join(root, "bin"))
        largest = max(p.numel() for p in TinyGPT(MODEL).parameters()) * 4
        lines = [f"TinyGPT {saved[0]['numel'] / 1e6:.0f}M params; checkpoint {size / 2**30:.2f} GiB; "
                 f"largest tensor {largest / 2**20:.0f} MiB; output shards of 256 MiB"]
        for name, results in (("save (2 ranks, stage 2)", saved), ("load (1 rank, stage 1)", loaded),
                              ("convert to safetensors", [safetensors]), ("convert to pytorch_model.bin", [torch_bin])):
            for r, res in enumerate(results):
                rate = size / res["seconds"] / 2**20
                lines.append(f"  {name:<26} rank {r}: {res['seconds']:6.2f} s ({rate:6.0f} MiB/s of checkpoint), "
                             f"RSS before {res['rss_before_mib']:6.0f} MiB, peak {res['peak_mib']:6.0f} MiB "
                             f"(+{res['peak_mib'] - res['rss_before_mib']:.0f})")
        sys.stdout.write("\n".join(lines) + "\n")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
