"""The memory ledger: every byte a strategy holds for the life of training, by category and tier.

A strategy lists its long-lived tensors (flat buffers, master copies, optimizer state) into a
`MemoryLedger` each time a report is asked for, so the report can never drift from what is held.
Transient buffers (a step's fp32 gradient copy, buckets) are recorded by their peak size, apart
from model states. Categories are design.md's vocabulary; tiers say where the bytes are: "device"
(what the model trains on, even when that is the CPU), "cpu" (offloaded to host memory), "nvme".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

import torch


class Category(str, Enum):
    """What a held byte is for."""

    PARAM16 = "param16"  # 16-bit working parameters
    PARAM32_MASTER = "param32_master"  # fp32 parameters the optimizer updates (fp32 training: the params)
    GRAD = "grad"  # gradient accumulation buffers
    OPTIM_STATE = "optim_state"  # optimizer state (Adam's exp_avg, exp_avg_sq, step)
    BUFFER = "buffer"  # module buffers (running stats, position ids)
    PARAM_SECONDARY = "param_secondary"  # hpZ: this rank's secondary partition of the working parameters
    PARAM_4BIT = "param4bit"  # frozen 4-bit weights (bitsandbytes' packed codes, in their storage dtype's container)
    QUANT_STATE = "quant_state"  # the 4-bit weights' quantization statistics and maps, whole on every rank


DEVICE, CPU, NVME = "device", "cpu", "nvme"
"""Memory tiers: the device the model trains on (a GPU, or the CPU on a CPU-only machine), host
memory used to offload from it, and files on NVMe."""

MODEL_STATE_CATEGORIES = (Category.PARAM16, Category.PARAM32_MASTER, Category.GRAD, Category.OPTIM_STATE,
                          Category.PARAM_SECONDARY, Category.PARAM_4BIT, Category.QUANT_STATE)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (a view counts its elements, not its base)."""
    return tensor.numel() * tensor.element_size()


@dataclass
class MemoryLedger:
    """Bytes by (category, tier), plus named transient peaks; `tensors` keeps what was counted, by
    (category, tier), for `engine.offload_states` to find."""

    held: dict[tuple[Category, str], int] = field(default_factory=lambda: defaultdict(int))
    transient_peak: dict[str, int] = field(default_factory=dict)
    tensors: dict[tuple[Category, str], list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))

    def add(self, category: Category, tensors: torch.Tensor | Iterable[torch.Tensor], tier: str = DEVICE) -> None:
        """Count `tensors` (never views of something already counted) under `category`, in `tier`.
        Empty tensors are skipped. A device tensor whose storage is parked in host memory
        (`engine.offload_states`: the storage is 0 bytes until `reload_states`) counts in "cpu"."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for t in tensors:
            if not t.numel():  # holds nothing (a stage without that kind of state); not a row of its own
                continue
            where = CPU if tier == DEVICE and t.untyped_storage().nbytes() == 0 else tier
            self.held[(category, where)] += nbytes(t)
            self.tensors[(category, where)].append(t)

    def add_bytes(self, category: Category, tier: str, num_bytes: int) -> None:
        """Count bytes that are not a torch tensor (a file on NVMe, say)."""
        self.held[(category, tier)] += num_bytes

    def bytes(self, category: Category | None = None, tier: str | None = None) -> int:
        """Total bytes, optionally of one category and/or one tier."""
        return sum(
            b for (c, t), b in self.held.items()
            if (category is None or c == category) and (tier is None or t == tier)
        )

    def model_state_bytes(self, tier: str | None = None) -> int:
        """Parameters + gradients + master weights + optimizer state (design.md §3's table)."""
        return sum(self.bytes(c, tier) for c in MODEL_STATE_CATEGORIES)

    def report(self) -> dict:
        """Plain data: {"held": {category: {tier: bytes}}, "model_states": bytes, "transient_peak": {...}}."""
        held: dict[str, dict[str, int]] = defaultdict(dict)
        for (category, tier), b in sorted(self.held.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
            held[category.value][tier] = b
        return {
            "held": dict(held),
            "model_states": self.model_state_bytes(),
            "transient_peak": dict(self.transient_peak),
        }


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (Adam: exp_avg, exp_avg_sq and the step counter)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def is_quantized(param: torch.Tensor) -> bool:
    """Whether `param` is a 4-bit weight: bitsandbytes' `Params4bit` (its packed codes, in a uint8 or
    `bnb_4bit_quant_storage` container) carries the `quant_state` it is dequantized with."""
    return getattr(param, "quant_state", None) is not None


def quant_state_tensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor of the quantization states of the 4-bit weights among `params`, each once: absmax
    and the code map, and with double quantization the 8-bit absmax's offset and the nested state's
    absmax and map. bitsandbytes keeps them as plain attributes of the weight (no parameter, no buffer),
    so nothing else counts them; read duck-typed, as the runtime does not import bitsandbytes."""
    found: dict[int, torch.Tensor] = {}  # by id: a tensor two weights share counts once

    def walk(state: object) -> None:
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                found.setdefault(id(value), value)
            elif type(value) is type(state):  # the nested state of double quantization
                walk(value)

    for p in params:
        if is_quantized(p):
            walk(p.quant_state)
    return list(found.values())


def add_flat(led: MemoryLedger, category: Category, tensor: torch.Tensor, start: int, params: list[torch.Tensor],
             offsets: Iterable[int], tier: str = DEVICE) -> None:
    """Count `tensor`, elements [start, start + numel) of a flat buffer in which `params` start at
    `offsets`: the parts holding 4-bit weights as `Category.PARAM_4BIT`, the rest (other parameters,
    padding) as `category`. The parts are views of `tensor`, so `engine.offload_states` still finds its storage."""
    stop, pieces, at = start + tensor.numel(), [], start
    for p, offset in zip(params, offsets):
        lo, hi = max(start, offset), min(stop, offset + _full_numel(p))
        if lo < hi and is_quantized(p):
            pieces += [(category, at, lo), (Category.PARAM_4BIT, lo, hi)]
            at = hi
    if not pieces:
        led.add(category, tensor, tier)
        return
    parked = tier == DEVICE and tensor.untyped_storage().nbytes() == 0  # offload_states: no view can be cut
    for cat, lo, hi in pieces + [(category, at, stop)]:
        if lo < hi and parked:  # counted where its bytes are, as `add` counts a parked tensor
            led.add_bytes(cat, CPU, (hi - lo) * tensor.element_size())
        elif lo < hi:
            led.add(cat, tensor[lo - start : hi - start], tier)


def quantized_numel(params: list[torch.Tensor], offsets: Iterable[int], start: int, stop: int) -> int:
    """Elements of flat range [start, stop) that hold 4-bit weights (see `add_flat`)."""
    return sum(max(0, min(stop, o + _full_numel(p)) - max(start, o)) for p, o in zip(params, offsets) if is_quantized(p))


def _full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter, also while stage 3 has it partitioned (`ds_numel`)."""
    return getattr(p, "ds_numel", p.numel())


def add_module_states(led: MemoryLedger, module: torch.nn.Module) -> None:
    """The module's buffers, and its 4-bit weights' quantization states (held whole on every rank,
    beside the partitioned weights, at every stage)."""
    led.add(Category.BUFFER, list(module.buffers()))
    led.add(Category.QUANT_STATE, quant_state_tensors(module.parameters()))


def format_ledger(report: dict, fmt_bytes) -> list[str]:
    """Render `MemoryLedger.report()` as aligned lines: one per category and tier, the model-state
    total, then each transient peak."""
    rows = [(f"{category} ({tier})", b) for category, tiers in report["held"].items() for tier, b in tiers.items()]
    rows.append(("model states", report["model_states"]))
    rows += [(f"transient peak: {name}", b) for name, b in report["transient_peak"].items()]
    width = max(len(label) for label, _ in rows)
    return [f"  {label:<{width}} {fmt_bytes(b):>12}" for label, b in rows]
