"""The flops profiler (DeepSpeed's `flops_profiler` section): one micro-batch's FLOPs, parameters and
forward latency per module.

[Note: the flops profile]
When `flops_profiler.enabled`, every rank profiles the first micro-batch after `profile_step`
optimizer steps (DeepSpeed's count: with the default 1, the second step's first micro-batch; the
first step pays for warm-up; an engine that does not train counts forwards instead, and profiles
the forward only), and rank 0 logs the profile through the zerodp logger at INFO (or writes it to `output_file`). Every rank
profiles so that the ranks stay in step (a collective inside the model waits for the slowest).
The FLOPs are counted, not estimated: torch's FlopCounterMode runs through the forward
(engine.forward) and, separately, through the backward (engine.backward), so the backward's own
FLOPs and any activation-checkpointing recomputation are in its count (DeepSpeed estimates the
backward as 2x the forward, plus `recompute_fwd_factor`). Per module: its parameters (at stage 3 the
full shape's elements, `ds_numel`), the forward FLOPs counted between its forward pre-hook and its
forward hook (children included; a container whose forward is never called, an nn.ModuleList, sums
its children's), its `calls`, and the forward's wall time between them (synchronising the
device on CUDA; at stage 3 a module's own parameter gather runs in a hook before the timer starts).
The profile also feeds engine.step_report(): every later step reports `flops` (the profiled
micro-batch's forward + backward FLOPs times the micro-batches per step, so it assumes the same
shapes), `flops_per_s` and, in 16 bits on a GPU whose peak zerodp.gpus.GPUS lists, `mfu`.
A backward the engine does not run (`loss.backward()` of the user's) is not counted: the profile
completes at the step with `backward_flops` None, and the step report's FLOPs stay None.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from zerodp.gpus import peak_flops_of
from zerodp.log import global_rank, log_rank0


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense 16-bit peak FLOP/s of a CUDA device zerodp.gpus.GPUS knows (by its name), for
    the model FLOPs utilisation of a bf16 / fp16 run; None otherwise (a CPU, another GPU, fp32)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def check_output_file(path: str | None) -> None:
    """Refuse (on every rank, before any communication) an output file rank 0 could not write."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        from zerodp.config import ConfigError

        raise ConfigError(f"flops_profiler.output_file: {path!r} cannot be written (its directory {parent!r} "
                          "does not exist or is not writable); create it or choose another path")


class FlopsProfiler:
    """Profiles one micro-batch of `module`; `profile` holds the result once it has run."""

    def __init__(self, module: nn.Module, config: Any, device: torch.device) -> None:
        self.module, self.config, self.device = module, config, device
        self.profile: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None  # the forward profiled, its backward not yet

    def due(self, steps: int, backward: bool) -> bool:
        return self.config.enabled and self.profile is None and self._pending is None \
            and steps == self.config.profile_step and (torch.is_grad_enabled() or not backward)

    @contextmanager
    def forward(self, steps: int, backward: bool = True) -> Iterator[None]:
        """Profile this forward if it is the one: `steps` optimizer steps done (a forward-only engine:
        forwards done, and `backward` False: the profile is complete after the forward)."""
        if not self.due(steps, backward):
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        names = {m: name for name, m in self.module.named_modules()}
        rows = {m: {"name": name or type(m).__name__, "type": type(m).__name__,
                    "depth": 0 if not name else name.count(".") + 1,
                    "params": sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters()),
                    "forward_flops": 0, "forward_seconds": 0.0, "calls": 0} for m, name in names.items()}
        started: dict[nn.Module, list[tuple[float, int]]] = {}
        counter = FlopCounterMode(display=False)

        def pre(m: nn.Module, *_: Any) -> None:
            self._sync()
            started.setdefault(m, []).append((time.perf_counter(), counter.get_total_flops()))

        def post(m: nn.Module, *_: Any) -> None:
            if not started.get(m):  # a hook installed while the module ran
                return
            self._sync()
            start, flops = started[m].pop()
            rows[m]["forward_seconds"] += time.perf_counter() - start
            rows[m]["forward_flops"] += counter.get_total_flops() - flops
            rows[m]["calls"] += 1

        handles = [h for m in names for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        self._sync()
        start = time.perf_counter()
        try:
            with counter:
                yield
            self._sync()
        finally:
            for handle in handles:
                handle.remove()
        for m in reversed(names):  # a container never called (nn.ModuleList): its children's sums
            if rows[m]["calls"] == 0:
                for key in ("forward_flops", "forward_seconds"):
                    rows[m][key] = sum(rows[c][key] for c in m.children())
        self._pending = {"forward_flops": counter.get_total_flops(), "forward_seconds": time.perf_counter() - start,
                         "modules": list(rows.values())}
        if not backward:
            self.finish()

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Count the backward of the profiled forward, then report."""
        if self._pending is None:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        self._sync()
        start = time.perf_counter()
        with counter:
            yield
        self._sync()
        self.finish(counter.get_total_flops(), time.perf_counter() - start)

    def finish(self, backward_flops: int | None = None, backward_seconds: float | None = None) -> None:
        """Complete the profile of the pending forward and report it; without a backward (a
        forward-only engine, or a `loss.backward()` outside engine.backward) its figures are None."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        flops = pending["forward_flops"] + (backward_flops or 0)
        seconds = pending["forward_seconds"] + (backward_seconds or 0.0)
        self.profile = {"step": self.config.profile_step + 1, **pending, "backward_flops": backward_flops,
                        "backward_seconds": backward_seconds, "flops": flops,
                        "flops_per_s": flops / seconds if seconds > 0 else None}
        self._report()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _report(self) -> None:
        text = format_profile(self.profile, self.config.module_depth, self.config.top_modules, self.config.detailed)
        if global_rank() != 0:
            return
        if self.config.output_file:
            with open(self.config.output_file, "w") as f:
                f.write(text + "\n")
            log_rank0(f"flops profile of step {self.profile['step']} written to {self.config.output_file}")
        else:
            log_rank0("%s", text)


def _flops(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} "


def format_profile(profile: dict, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
    """The profile as text: totals, the `top_modules` modules with the most forward FLOPs at each depth
    up to `module_depth` (-1: every depth), and with `detailed` every module as a tree."""
    modules = [m for m in profile["modules"] if module_depth < 0 or m["depth"] <= module_depth]
    root = profile["modules"][0]
    seconds = profile["forward_seconds"] + (profile["backward_seconds"] or 0.0)
    rate = f"{_flops(profile['flops_per_s'])}FLOP/s" if profile["flops_per_s"] else "n/a"
    if profile["backward_flops"] is None:
        backward = "not counted (no engine.backward of this micro-batch)"
    else:
        backward = (f"{_flops(profile['backward_flops'])}FLOP in {profile['backward_seconds'] * 1e3:.1f} ms "
                    "(counted, recomputation included; the time includes its communication)")
    lines = [
        f"flops profile: step {profile['step']}, its first micro-batch (FLOPs counted by torch's FlopCounterMode)",
        f"  parameters        {root['params']:,}",
        f"  forward FLOPs     {_flops(profile['forward_flops'])}FLOP in {profile['forward_seconds'] * 1e3:.1f} ms",
        f"  backward FLOPs    {backward}",
        f"  total             {_flops(profile['flops'])}FLOP in {seconds * 1e3:.1f} ms: {rate}",
        f"top {top_modules} module(s) per depth by forward FLOPs (share of the model's forward FLOPs, latency):",
    ]

    def row(m: dict) -> str:
        share = m["forward_flops"] / profile["forward_flops"] if profile["forward_flops"] else 0.0
        latency = m["forward_seconds"] / root["forward_seconds"] if root["forward_seconds"] else 0.0
        return (f"{m['name']} ({m['type']}): {m['params']:,} params, {_flops(m['forward_flops'])}FLOP "
                f"({100 * share:.1f}%), {m['forward_seconds'] * 1e3:.2f} ms ({100 * latency:.1f}%)")

    for depth in sorted({m["depth"] for m in modules}):
        at = sorted((m for m in modules if m["depth"] == depth), key=lambda m: -m["forward_flops"])[:top_modules]
        lines.append(f"  depth {depth}: " + "; ".join(row(m) for m in at))
    if detailed:
        lines.append("every module (forward; a module's figures include its children's):")
        lines += ["  " + "  " * m["depth"] + row(m) for m in modules]
    return "\n".join(lines)
