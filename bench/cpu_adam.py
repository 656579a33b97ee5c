"""The optimizer step that CPU offload runs: torch's AdamW on the CPU against DeepSpeed's CPUAdam.

    python bench/cpu_adam.py                          # 50M fp32 params, 1 and 2 threads
    python bench/cpu_adam.py --numel 100e6 --threads 1,2 --steps 10

One flat fp32 parameter (what an offloaded owned shard is) with a random gradient; every
optimizer gets the same data and hyperparameters; the median step time of `--steps` steps after
2 warm-up steps, and the effective memory bandwidth (AdamW reads param, grad, exp_avg, exp_avg_sq
and writes param, exp_avg, exp_avg_sq: 28 bytes per element). DeepSpeed's CPUAdam is JIT-built on
first use (about 30 s); it is skipped with a note when DeepSpeed is not installed. Also checks that
the implementations agree (max |difference| of the parameter after the timed steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch(kind: str):
    def make(param: torch.Tensor) -> torch.optim.Optimizer:
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
        return torch.optim.AdamW([param], **HYPER, **flags)
    return make


def _deepspeed(param: torch.Tensor) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([param], **HYPER, adamw_mode=True)


def _time(make, numel: int, steps: int) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=g))
    grad = torch.randn(numel, generator=g) * 1e-2
    opt = make(param)
    times = []
    for i in range(steps + 2):
        param.grad = grad
        start = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), param.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=50e6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    numel = int(args.numel)
    candidates = {"torch AdamW fused": _torch("fused"), "torch AdamW foreach": _torch("foreach"),
                  "torch AdamW for-loop": _torch("for-loop"), "DeepSpeed CPUAdam": _deepspeed}
    print(f"{numel / 1e6:.0f}M fp32 elements, median of {args.steps} steps, torch {torch.__version__}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        results = {}
        for name, make in candidates.items():
            try:
                results[name] = _time(make, numel, args.steps)
            except Exception as err:  # noqa: BLE001 - a missing or unbuildable DeepSpeed op is reported
                print(f"  {name}: skipped ({type(err).__name__}: {str(err).splitlines()[0][:100]})")
        base = results["torch AdamW fused"][0]
        reference = results["torch AdamW fused"][1]
        print(f"threads {threads}:")
        for name, (seconds, param) in results.items():
            gbs = 28 * numel / seconds / 1e9
            gap = (param - reference).abs().max().item()
            print(f"  {name:<22} {seconds * 1e3:8.1f} ms  {gbs:6.2f} GB/s  {seconds / base:5.2f}x fused  "
                  f"max|diff| {gap:.1e}")


if __name__ == "__main__":
    main()
