"""ZeRO-Infinity on this machine: train a GPT whose model states exceed RAM, from NVMe; or, with
--generate, ZeRO-Inference: generate from a GPT whose 16-bit weights alone exceed RAM.

    python bench/infinity.py --nvme-path /work/nvme_swap                 # 3.3B params, 2 steps
    python bench/infinity.py --nvme-path /tmp/swap --d-model 512 --n-layer 4 --steps 2   # a quick check
    python bench/infinity.py --nvme-path /work/nvme_swap --generate 3 --d-model 5120 --n-layer 48   # 15.1B, inference

--generate N builds the model under `zero.Init` with no optimizer (a forward-only engine, every
parameter shard in a swap file, `max_in_cpu` 0), greedily generates N tokens (no KV cache: each token
is one forward, which streams every weight from the disk once), and reports tokens/s against the
disk-bound limit: the `dd` read rate / the 16-bit weight bytes (one token per full read of the weights).

One rank, ZeRO stage 3, bf16, the model built under `zero.Init` (never whole in memory), optimizer
state (fp32 master + Adam, 12 bytes per parameter) and parameter shards (2 bytes) in swap files
under --nvme-path, gradients (2 bytes) in host memory. Reports: parameters, model-state bytes
(16 per parameter) against this machine's RAM, peak RSS, time to build and to set up, each step's
time, and the read / write bandwidth the swap files achieved during the steps, against the disk's
sequential bandwidth measured with `dd` (O_DIRECT, 1 MiB blocks) before and after the steps (their
mean: this disk's speed drifts), and the share of the step time the disk would need for the bytes
moved at dd's rates. JSON results go to bench/results/infinity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerodp  # noqa: E402
from zerodp.demo import GPTConfig, TinyGPT  # noqa: E402
from zerodp.sizes import format_bytes  # noqa: E402


def dd_bandwidth(folder: Path, mib: int) -> tuple[float, float]:
    """Sequential write then read MB/s of `mib` MiB with dd, O_DIRECT, 1 MiB blocks."""
    path = folder / "dd_probe.bin"
    try:
        write = _dd(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fdatasync"])
        read = _dd(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return write, read


def _dd(argv: list[str]) -> float:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(match.group(1)) / float(match.group(2)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--d-model", type=int, default=3072)
    parser.add_argument("--n-layer", type=int, default=29)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dd-mib", type=int, default=4096, help="size of the dd probe")
    parser.add_argument("--threads", type=int, default=4, help="aio.intra_op_parallelism")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="ZeRO-Inference: generate N tokens from a forward-only engine instead of training")
    parser.add_argument("--param-buffer-size", type=float, default=1e8,
                        help="--generate: offload_param.buffer_size (elements a read-ahead buffer holds; default 1e8)")
    parser.add_argument("--param-buffer-count", type=int, default=5,
                        help="--generate: offload_param.buffer_count (units read ahead; default 5)")
    args = parser.parse_args()
    if args.generate:
        return generate(args)
    folder, dd_write, dd_read, model_cfg = _set_up(args)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": args.threads},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(folder), "buffer_count": 3},
            "offload_param": {"device": "nvme", "nvme_path": str(folder), "max_in_cpu": 0}},
    }
    start = time.perf_counter()
    with zerodp.zero.Init(config=config):
        model = TinyGPT(model_cfg)
    built = time.perf_counter() - start
    num_params = sum(p.ds_numel for p in model.parameters())
    ram = _ram_bytes()
    print(f"model: {num_params / 1e9:.2f}B parameters, model states 16 x {num_params:,} = "
          f"{format_bytes(16 * num_params)} = {16 * num_params / ram:.2f}x this machine's RAM ({format_bytes(ram)}); "
          f"built under zero.Init in {built:.0f} s")
    start = time.perf_counter()
    engine, *_ = zerodp.initialize(model=model, config=config)
    set_up = time.perf_counter() - start
    print(f"initialize (regroup into units, write masters and shards to {folder}): {set_up:.0f} s")
    before = engine.swap_report()
    g = torch.Generator().manual_seed(0)
    step_times, phases = [], []
    for step in range(args.steps):
        idx = torch.randint(0, model_cfg.vocab_size, (args.micro_batch, args.seq_len), generator=g)
        t0 = time.perf_counter()
        loss = engine(idx, torch.roll(idx, 1, dims=1))
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": step_times[-1] - (t2 - t0)})
        print(f"step {step + 1}: loss {loss.item():.4f}, {step_times[-1]:.1f} s (forward {t1 - t0:.1f}, backward "
              f"{t2 - t1:.1f}, optimizer step {phases[-1]['step']:.1f}), peak RSS {format_bytes(_peak_rss())}")
    after = engine.swap_report()
    read_bytes = _delta(after, before, "read_bytes")
    written = _delta(after, before, "written_bytes")
    seconds = sum(step_times)
    # the disk's speed drifts on this (virtual) machine: probe it again and judge against the mean
    dd_write_after, dd_read_after = dd_bandwidth(folder, args.dd_mib)
    print(f"dd after the steps: write {dd_write_after:,.0f} MB/s, read {dd_read_after:,.0f} MB/s")
    dd_write, dd_read = (dd_write + dd_write_after) / 2, (dd_read + dd_read_after) / 2
    report = engine.memory_report()
    result = {
        "params": num_params, "model_state_bytes": 16 * num_params, "ram_bytes": ram,
        "peak_rss_bytes": _peak_rss(), "build_s": built, "initialize_s": set_up, "step_s": step_times, "phases_s": phases,
        "read_bytes": read_bytes, "written_bytes": written,
        "read_MBps": read_bytes / seconds / 1e6, "write_MBps": written / seconds / 1e6,
        "dd_read_MBps": dd_read, "dd_write_MBps": dd_write, "dd_after_MBps": [dd_read_after, dd_write_after],
        "held": report["held"],
        "io_read_busy_MBps": _busy(after, before, "read"), "io_write_busy_MBps": _busy(after, before, "write"),
        # the seconds the disk needs for these bytes at dd's rates, as a share of the step time
        "disk_busy_fraction": (read_bytes / (dd_read * 1e6) + written / (dd_write * 1e6)) / seconds,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "held"}, indent=1))
    print("ledger:", json.dumps(report["held"]))
    out = Path(__file__).parent / "results" / "infinity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    engine.destroy()


def _set_up(args: argparse.Namespace) -> tuple[Path, float, float, GPTConfig]:
    """The swap folder, dd's write and read MB/s there, the process group, and the GPT's sizes."""
    folder = Path(args.nvme_path)
    folder.mkdir(parents=True, exist_ok=True)
    dd_write, dd_read = dd_bandwidth(folder, args.dd_mib)
    print(f"dd on {folder}: write {dd_write:,.0f} MB/s, read {dd_read:,.0f} MB/s (O_DIRECT, 1 MiB blocks)")
    torch.manual_seed(0)
    zerodp.init_distributed()
    model_cfg = GPTConfig(vocab_size=8192, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer,
                          n_head=max(1, args.d_model // 128))
    return folder, dd_write, dd_read, model_cfg


def generate(args: argparse.Namespace) -> None:
    """ZeRO-Inference: N greedy tokens from a model whose 16-bit weights live only in swap files."""
    folder, _, dd_read, model_cfg = _set_up(args)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "bf16": {"enabled": True},
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": args.threads},
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(folder), "max_in_cpu": 0,
                              "buffer_size": args.param_buffer_size, "buffer_count": args.param_buffer_count}},
    }
    start = time.perf_counter()
    with zerodp.zero.Init(config=config):
        model = TinyGPT(model_cfg)
    built = time.perf_counter() - start
    num_params = sum(p.ds_numel for p in model.parameters())
    weight_bytes, ram = 2 * num_params, _ram_bytes()
    print(f"model: {num_params / 1e9:.2f}B parameters, 16-bit weights {format_bytes(weight_bytes)} = "
          f"{weight_bytes / ram:.2f}x this machine's RAM ({format_bytes(ram)}); built under zero.Init in {built:.0f} s")
    start = time.perf_counter()
    engine, *_ = zerodp.initialize(model=model, config=config)
    print(f"initialize (forward only: {engine.forward_only}): {time.perf_counter() - start:.0f} s; "
          f"ledger {json.dumps(engine.memory_report()['held'])}")
    idx = torch.randint(0, model_cfg.vocab_size, (args.micro_batch, 4), generator=torch.Generator().manual_seed(0))
    before, token_s = engine.swap_report(), []
    with torch.no_grad():
        for n in range(args.generate):
            t0 = time.perf_counter()
            logits = engine(idx, None)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            token_s.append(time.perf_counter() - t0)
            print(f"token {n + 1}: {token_s[-1]:.1f} s, peak RSS {format_bytes(_peak_rss())}")
    read_bytes = _delta(engine.swap_report(), before, "read_bytes")
    dd_write_after, dd_read_after = dd_bandwidth(folder, args.dd_mib)
    dd_read_mean = (dd_read + dd_read_after) / 2
    limit = dd_read_mean * 1e6 / weight_bytes  # tokens/s if every token only waited for one read of the weights
    achieved = args.generate / sum(token_s)
    result = {
        "params": num_params, "weight_bytes": weight_bytes, "ram_bytes": ram, "peak_rss_bytes": _peak_rss(),
        "build_s": built, "token_s": token_s, "tokens_per_s": achieved, "read_bytes": read_bytes,
        "read_bytes_per_token": read_bytes / args.generate, "dd_read_MBps": [dd_read, dd_read_after],
        "disk_bound_tokens_per_s": limit, "share_of_disk_bound": achieved / limit, "tokens": idx.tolist(),
    }
    print(json.dumps(result, indent=1))
    out = Path(__file__).parent / "results" / "zero_inference.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    engine.destroy()


def _delta(after: dict, before: dict, key: str) -> float:
    """`key` of engine.swap_report() summed over the stores, between two reports."""
    return sum(after[name][key] - before[name][key] for name in after)


def _busy(after: dict, before: dict, kind: str) -> float:
    """MB/s while the swap files had I/O of `kind` in flight (what the disk gave when asked)."""
    num_bytes, seconds = {"read": ("read_bytes", "read_seconds"), "write": ("written_bytes", "write_seconds")}[kind]
    return _delta(after, before, num_bytes) / max(_delta(after, before, seconds), 1e-9) / 1e6


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


if __name__ == "__main__":
    main()
