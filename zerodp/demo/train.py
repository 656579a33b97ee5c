"""The per-rank training script behind `zerodp demo` (run by torchrun, one process per rank).

    zerodp demo --nproc 2 --stage 1 --dtype bf16 --steps 100 --activation-checkpointing
    # is: zerodp run --standalone --nproc-per-node 2 -m zerodp.demo.train --config CFG --steps 100 ...

Rank 0 draws the progress bar and writes the summary (loss first -> last, the memory ledger by
category, the communication of one step, the batch math) to stdout.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import TextIO

import torch

import zerodp
from zerodp.config.read import read_input
from zerodp.demo import DEMO_DEFAULT, DEMO_LR, DEMO_MICRO_BATCH_SIZE, DEMO_STEPS, SyntheticTaskDataset, TinyGPT
from zerodp.memory import format_ledger
from zerodp.metrics import ProgressBar, Throughput, flops_per_token, format_breakdown
from zerodp.profiler import format_profile
from zerodp.sizes import format_bytes, format_count

_DTYPE_SECTIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}


def demo_config(path: str | None = None, stage: int | None = None, dtype: str | None = None) -> dict:
    """The demo's DeepSpeed config: `path`'s JSON (or the embedded default) with `stage` and
    `dtype` overriding it."""
    if path is not None:  # read as every config is: size-capped, never blocking, a JSON object (ConfigError)
        config = read_input(path, None)[0]
    else:
        config = {
            "train_micro_batch_size_per_gpu": DEMO_MICRO_BATCH_SIZE,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": DEMO_LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_type": "linear"}},
        }
    zero = config.setdefault("zero_optimization", {}) if stage is not None else config.get("zero_optimization", {})
    if isinstance(zero, dict):  # else load_config names the section's type
        if stage is not None:
            zero["stage"] = stage
        if zero.get("stage") == 3:
            # DeepSpeed's default (1e5 elements) would keep every parameter of this small model whole
            zero.setdefault("stage3_param_persistence_threshold", 1000)
    if dtype is not None:
        config.pop("bf16", None)
        config.pop("fp16", None)
        config.update(copy.deepcopy(_DTYPE_SECTIONS[dtype]))
    return config


def train(config: dict, steps: int, out: TextIO, activation_checkpointing: bool = False) -> None:
    """Train TinyGPT on the copy task for `steps` optimizer steps; rank 0 reports to `out`."""
    zerodp.init_distributed()
    torch.manual_seed(0)
    model = TinyGPT(DEMO_DEFAULT)
    num_params = model.num_parameters()  # before initialize: stage 3 partitions the parameters
    if activation_checkpointing:
        zerodp.checkpointing.apply(model, policy="blocks")
    cfg = zerodp.load_config(config, world_size=zerodp.comm.get_world_size())
    dataset = SyntheticTaskDataset(steps * cfg.train_batch_size, DEMO_DEFAULT.seq_len, DEMO_DEFAULT.vocab_size, seed=0)
    engine, _, loader, _ = zerodp.initialize(model=model, config=config, training_data=dataset)
    rank0 = engine.global_rank == 0
    tokens = cfg.train_batch_size * DEMO_DEFAULT.seq_len
    fpt = flops_per_token(num_params, DEMO_DEFAULT.n_layer, DEMO_DEFAULT.seq_len, DEMO_DEFAULT.d_model)
    # TFLOPS only where they mean something (a GPU); on a CPU the figure only confuses
    throughput = Throughput(tokens_per_step=tokens, flops_per_token=fpt if engine.device.type == "cuda" else None)
    if rank0:
        out.write(f"zerodp demo: TinyGPT {format_count(num_params)} params, {dataset.describe()}\n"
                  f"  {engine.world_size} ranks, ZeRO stage {cfg.zero_optimization.stage}, {cfg.precision}, "
                  f"{cfg.batch.describe()}\n")
    batches = iter(loader)
    losses: list[float] = []
    start = time.perf_counter()
    with ProgressBar(steps, out if rank0 else _Null()) as bar:
        for _ in range(steps):
            for _ in range(cfg.gradient_accumulation_steps):
                idx, targets = next(batches)
                loss = engine(idx, targets)
                engine.backward(loss)
                engine.step()
            metrics = dict(engine.last_metrics, total_steps=steps,
                           model_state_bytes=engine.memory_report()["model_states"])
            metrics.update(throughput.update(metrics["step_time_s"]))
            losses.append(metrics["loss"])
            bar.update(engine.global_steps, metrics)
    if rank0:
        _summary(engine, losses, time.perf_counter() - start, tokens * steps, out)


def _summary(engine: zerodp.Engine, losses: list[float], seconds: float, tokens: int, out: TextIO) -> None:
    out.write(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps in {seconds:.1f} s "
              f"({tokens / seconds:,.0f} tokens/s, {engine.skipped_steps} skipped)\n")
    report = engine.memory_report()
    out.write(f"memory ledger, rank {engine.global_rank}:\n")
    out.write("\n".join(format_ledger(report, format_bytes)) + "\n")
    saved = sum(report["activations"].values())
    out.write(f"activations saved for backward, peak of the last step: {format_bytes(saved)}\n")
    step = engine.comm_report()["last_step"]
    out.write(f"communication per step, rank {engine.global_rank}: {step['total_numel']:,} elements "
              f"({format_bytes(step['total_bytes'])})\n")
    for op, rec in step["ops"].items():
        out.write(f"  {op:<26} {rec['calls']:>4} calls {rec['numel']:>12,} elements {format_bytes(rec['bytes']):>12}\n")
    out.write(f"the last step, rank {engine.global_rank}: {format_breakdown(engine.step_report())}\n")
    profiler = engine.config.flops_profiler
    if engine.flops_profile is not None and not profiler.output_file:  # the demo quiets the INFO log it went to
        out.write(format_profile(engine.flops_profile, profiler.module_depth, profiler.top_modules,
                                 profiler.detailed) + "\n")


class _Null:
    """A stream that drops everything (ranks other than 0 draw no progress bar)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zerodp.demo.train")
    parser.add_argument("--config", default=None, help="DeepSpeed JSON config (default: the demo's)")
    parser.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"optimizer steps (default {DEMO_STEPS})")
    parser.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block")
    args = parser.parse_args(argv)
    # Written as a DeepSpeed script is: no destroy_process_group at the end (zerodp.comm leaves
    # nothing for interpreter shutdown to tear down).
    train(demo_config(args.config), args.steps, sys.stdout, args.activation_checkpointing)


if __name__ == "__main__":
    main()
