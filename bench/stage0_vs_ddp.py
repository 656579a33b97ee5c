"""Stage-0 step time side by side: torch DDP, DeepSpeed stage 0 (when installed) and zerodp stage 0,
plus FSDP2 (`fully_shard` per block: ZeRO-3-like, 1.5x the traffic, shown for reference), on the same
model and data, in one run.

    python bench/stage0_vs_ddp.py --nproc 2 --steps 30          # prints a table of ratios to DDP

Each framework runs in fresh processes (gloo on CPU, nccl on CUDA), one thread per rank; the
first `--warmup` steps are not timed; the reported time is the median step (forward, backward with
gradient all-reduce, optimizer). Results are also written as JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp.demo import GPTConfig, SyntheticTaskDataset, TinyGPT  # noqa: E402

MODEL = GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_layer=4, n_head=4)
MICRO_BATCH = 8
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _batches(rank: int, steps: int):
    data = SyntheticTaskDataset(10_000, MODEL.seq_len, MODEL.vocab_size, seed=rank)
    for step in range(steps):
        items = [data[(step * MICRO_BATCH + i) % len(data)] for i in range(MICRO_BATCH)]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _time_loop(step_fn, rank: int, steps: int, warmup: int) -> list[float]:
    times = []
    for i, (idx, targets) in enumerate(_batches(rank, steps + warmup)):
        dist.barrier()
        start = time.perf_counter()
        step_fn(idx, targets)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _ddp(model: torch.nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

    def step(idx, targets):
        ddp(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def _fsdp2(model: torch.nn.Module):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=True)

    def step(idx, targets):
        model(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def _config(world: int) -> dict:
    return {"train_batch_size": MICRO_BATCH * world, "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0},
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}}


def _engine_step(engine):
    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    return step


def _zerodp(model: torch.nn.Module):
    import zerodp

    config = _config(dist.get_world_size())
    engine, *_ = zerodp.initialize(model=model, config=config)
    return _engine_step(engine)


def _deepspeed(model: torch.nn.Module):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=_config(dist.get_world_size()), dist_init_required=False)
    return _engine_step(engine)


FRAMEWORKS = {"ddp": _ddp, "fsdp2": _fsdp2, "deepspeed": _deepspeed, "zerodp": _zerodp}


def _worker(rank: int, world: int, port: int, name: str, steps: int, warmup: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        step_fn = FRAMEWORKS[name](TinyGPT(MODEL))
        times = _time_loop(step_fn, rank, steps, warmup)
        if rank == 0:
            out.put((name, times))
    except Exception as err:  # noqa: BLE001 - a framework that cannot run is reported, not fatal
        if rank == 0:
            out.put((name, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--frameworks", default="ddp,zerodp,fsdp2,deepspeed")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results: dict[str, object] = {}
    for name in args.frameworks.split(","):
        queue = ctx.Queue()
        mp.start_processes(_worker, args=(args.nproc, _free_port(), name, args.steps, args.warmup, queue),
                           nprocs=args.nproc, start_method="spawn")
        results[name] = queue.get()[1]
    _report(results, args)


def _report(results: dict[str, object], args: argparse.Namespace) -> None:
    n_params = sum(p.numel() for p in TinyGPT(MODEL).parameters())
    lines = [f"TinyGPT {n_params:,} params, micro batch {MICRO_BATCH} x seq {MODEL.seq_len}, {args.nproc} ranks, "
             f"{args.steps} timed steps (median), torch {torch.__version__}"]
    base = statistics.median(results["ddp"]) if isinstance(results.get("ddp"), list) else None
    for name, value in results.items():
        if isinstance(value, list):
            median = statistics.median(value)
            ratio = f"{median / base:.2f}x DDP" if base else ""
            lines.append(f"  {name:<10} {median * 1e3:8.1f} ms/step  {ratio}")
        else:
            lines.append(f"  {name:<10} not run: {value}")
    sys.stdout.write("\n".join(lines) + "\n")
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "stage0_vs_ddp.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
