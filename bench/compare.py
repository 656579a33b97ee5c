"""Step time and peak memory side by side: torch DDP, FSDP2, DeepSpeed and zerodp, one run.

    python bench/compare.py                              # 23M-param GPT, 2 ranks, fp32 and bf16
    python bench/compare.py --model small --dtypes fp32 --frameworks ddp,zerodp0,deepspeed0,fsdp2
    python bench/compare.py --stage3                     # = --frameworks ddp,fsdp2_3,deepspeed3,zerodp3

Frameworks: ddp (torch DDP; bf16 = autocast over fp32 params), fsdp2 (`fully_shard` per block,
`reshard_after_forward=False`: ZeRO-2-like; bf16 = MixedPrecisionPolicy), fsdp2_3 (the same with
`reshard_after_forward=True`: ZeRO-3-like), deepspeed0/1/2/3 (when installed; stage 3 with its
default stage-3 settings), zerodp0/1/2/3 (stage 3 with its default settings). Every framework runs
in fresh processes (gloo on CPU, one thread per rank, OMP_NUM_THREADS=1), and the frameworks are
interleaved over `--rounds` rounds so a slow spell of the machine hits all of them. Reported: median
step time over all timed steps (forward, backward with gradient reduction, clipping, optimizer) as a
ratio to DDP, and each rank's peak RSS (max over ranks and rounds). JSON results go to
bench/results/ (compare_<model>.json; compare_<model>_stage3.json with --stage3).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp.demo import GPTConfig, SyntheticTaskDataset, TinyGPT  # noqa: E402

MODELS = {
    "small": (GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_layer=4, n_head=4), 8),
    "gpt23m": (GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layer=6, n_head=8), 2),
}
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
STAGE3 = "ddp,fsdp2_3,deepspeed3,zerodp3"


def _batches(model_cfg: GPTConfig, micro_batch: int, rank: int, steps: int):
    data = SyntheticTaskDataset(10_000, model_cfg.seq_len, model_cfg.vocab_size, seed=rank)
    for step in range(steps):
        items = [data[(step * micro_batch + i) % len(data)] for i in range(micro_batch)]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _torch_step(model: torch.nn.Module, forward, dtype: str):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def step(idx, targets):
        with autocast:
            loss = forward(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return step


def _ddp(model: torch.nn.Module, dtype: str, stage: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_step(model, DDP(model), dtype)


def _fsdp2(model: torch.nn.Module, dtype: str, stage: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    reshard = stage == 3  # True: parameters freed after forward and re-gathered for backward (ZeRO-3)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp_policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp_policy)
    return _torch_step(model, model, "fp32")  # mixed precision is FSDP's policy, not autocast


def _ds_config(micro_batch: int, dtype: str, stage: int) -> dict:
    config = {"train_batch_size": micro_batch * dist.get_world_size(), "train_micro_batch_size_per_gpu": micro_batch,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine_step(engine):
    def step(idx, targets):
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    return step


def _zerodp(model: torch.nn.Module, dtype: str, stage: int, micro_batch: int):
    import zerodp

    engine, *_ = zerodp.initialize(model=model, config=_ds_config(micro_batch, dtype, stage))
    return _engine_step(engine)


def _deepspeed(model: torch.nn.Module, dtype: str, stage: int, micro_batch: int):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(micro_batch, dtype, stage), dist_init_required=False)
    return _engine_step(engine)


def _build(name: str, model: torch.nn.Module, dtype: str, micro_batch: int):
    if name == "ddp":
        return _ddp(model, dtype, 0)
    if name == "fsdp2":
        return _fsdp2(model, dtype, 2)
    if name == "fsdp2_3":
        return _fsdp2(model, dtype, 3)
    stage = int(name[-1])
    return (_zerodp if name.startswith("zerodp") else _deepspeed)(model, dtype, stage, micro_batch)


def _worker(rank: int, world: int, port: int, name: str, model_name: str, dtype: str, steps: int,
            warmup: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model_cfg, micro_batch = MODELS[model_name]
    try:
        torch.manual_seed(0)
        step_fn = _build(name, TinyGPT(model_cfg), dtype, micro_batch)
        times = []
        for i, (idx, targets) in enumerate(_batches(model_cfg, micro_batch, rank, steps + warmup)):
            dist.barrier()
            start = time.perf_counter()
            step_fn(idx, targets)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.put((rank, {"times": times, "peak_rss": peak_rss}))
    except Exception as err:  # noqa: BLE001 - a framework that cannot run is reported, not fatal
        where = traceback.extract_tb(err.__traceback__)[-1]
        out.put((rank, {"error": f"{type(err).__name__}: {err} ({where.filename}:{where.lineno})",
                        "traceback": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(ctx, args, name: str, dtype: str) -> list[dict]:
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(args.nproc, _free_port(), name, args.model, dtype, args.steps, args.warmup, queue),
                       nprocs=args.nproc, start_method="spawn")
    return [queue.get()[1] for _ in range(args.nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt23m")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--frameworks", default="ddp,fsdp2,deepspeed1,deepspeed2,zerodp0,zerodp1,zerodp2")
    parser.add_argument("--stage3", action="store_true", help=f"shorthand for --frameworks {STAGE3}")
    args = parser.parse_args()
    if args.stage3:
        args.frameworks = STAGE3
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    results: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for name in args.frameworks.split(","):
                print(f"round {round_ + 1}/{args.rounds}: {name}/{dtype}", file=sys.stderr, flush=True)
                entry = results.setdefault(f"{name}/{dtype}", {"times": [], "peak_rss": 0})
                for rank_result in _run_one(ctx, args, name, dtype):
                    if "error" in rank_result:
                        entry["error"] = rank_result["error"]
                        entry["traceback"] = rank_result["traceback"]
                    else:
                        entry["times"] += rank_result["times"]
                        entry["peak_rss"] = max(entry["peak_rss"], rank_result["peak_rss"])
    _report(results, args)


def _report(results: dict[str, dict], args: argparse.Namespace) -> None:
    model_cfg, micro_batch = MODELS[args.model]
    n_params = sum(p.numel() for p in TinyGPT(model_cfg).parameters())
    lines = [f"TinyGPT {n_params / 1e6:.1f}M params, micro batch {micro_batch} x seq {model_cfg.seq_len}, "
             f"{args.nproc} ranks, {args.rounds} rounds x {args.steps} timed steps, torch {torch.__version__}",
             f"  {'framework':<18} {'ms/step':>9} {'vs DDP':>7} {'peak RSS/rank':>14}"]
    for key, entry in results.items():
        if "error" in entry:
            lines.append(f"  {key:<18} not run: {entry['error']}")
            continue
        median = statistics.median(entry["times"])
        base = results.get(f"ddp/{key.split('/')[1]}", {}).get("times")
        ratio = f"{median / statistics.median(base):.2f}x" if base else "-"
        lines.append(f"  {key:<18} {median * 1e3:9.1f} {ratio:>7} {entry['peak_rss'] / 2**20:11.0f} MiB")
    for dtype in args.dtypes.split(","):  # zerodp3 against the other ZeRO-3 implementations
        mine = results.get(f"zerodp3/{dtype}", {}).get("times")
        for other in ("fsdp2_3", "deepspeed3"):
            theirs = results.get(f"{other}/{dtype}", {}).get("times")
            if mine and theirs:
                lines.append(f"  zerodp3 / {other} ({dtype}): {statistics.median(mine) / statistics.median(theirs):.2f}x")
    sys.stdout.write("\n".join(lines) + "\n")
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    suffix = "_stage3" if args.stage3 else ""
    (out_dir / f"compare_{args.model}{suffix}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
