"""The model-state arithmetic of every ZeRO strategy: pure, numbers in, numbers out.

`model_states` and `flat_states` give the bytes per rank by ledger category (zerodp/memory.py) and tier, from
the same partition arithmetic the strategies allocate with (zero/layout.py's `group_layout`), so a prediction
and the ledger of the same run agree (tests/test_estimate.py). `module_flats` reads a model's shapes into
the flat buffers the strategies would build (the model may be on the meta device: no weights). The
preflight, the OOM doctor, the planner and the rows of `zerodp estimate` (zerodp/plan/estimate.py) read these.

[Note: the model-state arithmetic]
Ψ trainable elements in one flat group (a parameter count, or a model's), N ranks, the group padded
to P (a multiple of N) and cut into shards of P/N; w bytes per working element (2 in bf16/fp16, 4 in
fp32). Working parameters: w·Ψ (stage 0), w·P (stages 1-2: the flat buffer), w·P/N (stage 3). Gradients
in the working dtype (data_types.grad_accum_dtype unset): w·Ψ, w·P, w·P/N, w·P/N. fp32 masters in
bf16/fp16 (fp32 training: the parameters are their own masters, unless offloaded): 4·Ψ at stage 0,
4·P/N above. Adam's two moments: 8 bytes per element the rank's optimizer steps (stages 1-2: its
whole shard, padding included; stage 3: the parameters' elements in its shard; stage 0: Ψ), plus
4 bytes per optimizer tensor for `step`. Offloading the optimizer moves masters and moments to the
cpu or nvme tier and (from stage 2 on) gradients to host memory (on nvme, `step` stays there too);
offloading parameters (stage 3) moves the parameter shards to host memory, or to nvme beyond
offload_param.max_in_cpu elements. hpZ (`zero_hpz_partition_size` = S, stage 3) adds, per unit flat that is
sharded, a secondary copy of w·P/S on the device (`param_secondary`; zero/units.py's FlatShard).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from zerodp.memory import CPU, DEVICE, NVME, Category, is_quantized, nbytes, quant_state_tensors
from zerodp.zero.layout import group_layout

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq in fp32, per element
STEP_BYTES = 4  # torch's `step`: a 0-dim fp32 tensor per optimizer tensor


@dataclass(frozen=True)
class StrategySpec:
    """A ZeRO strategy as the estimator sees it: the stage, where the optimizer and the parameters live, the
    dtype. (zerodp/zero/base.py's Strategy is the one that trains.)"""

    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    dtype: str = "bf16"

    def device_twin(self) -> "StrategySpec":
        """The strategy whose device side runs the same code: nvme offload's is cpu offload's."""
        return StrategySpec(self.stage, "cpu" if self.offload_optimizer == "nvme" else self.offload_optimizer,
                        "cpu" if self.offload_param == "nvme" else self.offload_param, self.dtype)

    def describe(self) -> str:
        offload = [f"{what} -> {device}" for what, device in (("optimizer", self.offload_optimizer),
                                                               ("params", self.offload_param)) if device != "none"]
        return f"stage {self.stage}" + (f", offload {', '.join(offload)}" if offload else "")


def strategy_config(s: StrategySpec, micro_batch: int = 1, accumulation: int = 1) -> dict:
    """The DeepSpeed JSON config (a dict) that trains with `s`: AdamW, this micro-batch and
    gradient accumulation (default none); nvme offload needs an nvme_path added."""
    zero: dict = {"stage": s.stage}
    for key, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if device != "none":
            zero[key] = {"device": device}
    precision = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}, "fp32": {}}[s.dtype]
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero, **precision}


def every_strategy(dtype: str = "bf16") -> list[StrategySpec]:
    """Every strategy zerodp runs: stage 0; stages 1-2 x optimizer offload; stage 3 x optimizer
    offload x parameter offload."""
    out = [StrategySpec(0, dtype=dtype)]
    out += [StrategySpec(s, o, dtype=dtype) for s in (1, 2) for o in OFFLOAD_DEVICES]
    out += [StrategySpec(3, o, p, dtype=dtype) for o in OFFLOAD_DEVICES for p in OFFLOAD_DEVICES]
    return out


@dataclass
class ModelStates:
    """Bytes per rank by (category, tier), and the `StrategySpec` they are for."""

    strategy: StrategySpec
    held: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, category: Category, tier: str, num_bytes: int) -> None:
        if num_bytes:
            key = (category.value, tier)
            self.held[key] = self.held.get(key, 0) + num_bytes

    def bytes(self, tier: str | None = None) -> int:
        """Total bytes, or those of one tier."""
        return sum(b for (_, t), b in self.held.items() if tier is None or t == tier)


@dataclass(frozen=True)
class Flat:
    """A flat buffer a strategy allocates: its parameters' element counts, whether the optimizer
    trains them, and (stage 3) whether it stays whole (a persistent unit, or nothing to shard)."""

    numels: tuple[int, ...]
    trains: bool = True
    keep_full: bool = False
    quantized: tuple[bool, ...] = ()  # per parameter: a 4-bit weight (`param4bit`); empty: none is
    quant_state_bytes: int = 0  # its 4-bit weights' quantization states, whole on every rank

    def quantized_numel(self, start: int = 0, stop: int | None = None) -> int:
        """Elements of 4-bit weights in [start, stop) of the flat (unpadded order)."""
        stop, total, offset = sys.maxsize if stop is None else stop, 0, 0
        for n, q in zip(self.numels, self.quantized):
            total, offset = total + q * max(0, min(stop, offset + n) - max(start, offset)), offset + n
        return total


def model_states(numel: int, num_ranks: int, strategy: StrategySpec, rank: int = 0,
                 param_max_in_cpu: int = 1_000_000_000) -> ModelStates:
    """Model-state bytes of `rank` (default 0, which holds the most: padding sits on the last ranks)
    for `numel` trainable elements in one flat group, trained with Adam on `num_ranks` ranks (see
    [Note: the model-state arithmetic]). `param_max_in_cpu`: offload_param.max_in_cpu, the shard
    elements parameter offload to nvme keeps in host memory (DeepSpeed's default)."""
    return flat_states([Flat((numel,))], num_ranks, strategy, rank, param_max_in_cpu)


def flat_states(flats: list[Flat], num_ranks: int, strategy: StrategySpec, rank: int = 0,
                param_max_in_cpu: int = 1_000_000_000, buffer_bytes: int = 0, hpz_partition_size: int = 1) -> ModelStates:
    """Model-state bytes of `rank` for these flat buffers: at stages 0-2 the param groups (frozen
    parameters in flats that do not train, held whole), at stage 3 every unit's trainable and frozen
    flat in unit order, with `hpz_partition_size` > 1 (ZeRO++ hpZ) each sharded flat's secondary copy;
    plus `buffer_bytes` of module buffers."""
    s, w = strategy, DTYPES[strategy.dtype]
    out = ModelStates(s)
    out.add(Category.BUFFER, DEVICE, buffer_bytes)
    out.add(Category.QUANT_STATE, DEVICE, sum(f.quant_state_bytes for f in flats))
    working = Category.PARAM16 if w == 2 else Category.PARAM32_MASTER
    if s.stage == 0:
        trained = [n for f in flats if f.trains for n in f.numels]
        four_bit = sum(f.quantized_numel() for f in flats)
        out.add(Category.PARAM_4BIT, DEVICE, w * four_bit)
        out.add(working, DEVICE, w * (sum(n for f in flats for n in f.numels) - four_bit))
        out.add(Category.GRAD, DEVICE, w * sum(trained))
        out.add(Category.PARAM32_MASTER, DEVICE, 4 * sum(trained) if w == 2 else 0)
        out.add(Category.OPTIM_STATE, DEVICE, ADAM_STATE_BYTES * sum(trained) + STEP_BYTES * len(trained))
        return out
    in_cpu = 0  # stage 3, parameters offloaded to nvme: shard elements kept in host memory so far
    for f in flats:
        if s.stage < 3 and not f.trains:
            out.add(Category.PARAM_4BIT, DEVICE, w * f.quantized_numel())
            out.add(working, DEVICE, w * (sum(f.numels) - f.quantized_numel()))
            continue
        in_cpu = _add_flat(out, f, num_ranks, s, rank, param_max_in_cpu, in_cpu)
        if s.stage == 3 and hpz_partition_size > 1 and not f.keep_full:  # zero/units.py's FlatShard.secondary
            out.add(Category.PARAM_SECONDARY, DEVICE,
                    DTYPES[s.dtype] * group_layout(list(f.numels), num_ranks).padded_numel // hpz_partition_size)
    return out


def _add_flat(out: ModelStates, f: Flat, num_ranks: int, s: StrategySpec, rank: int, max_in_cpu: int,
              in_cpu: int) -> int:
    """One sharded flat buffer's bytes (stages 1-3); returns the shard elements now kept in host
    memory by nvme parameter offload."""
    w = DTYPES[s.dtype]
    working = Category.PARAM16 if w == 2 else Category.PARAM32_MASTER
    layout = group_layout(list(f.numels), num_ranks)
    shard = layout.shard_numel
    start, stop = layout.owned_range(rank)
    owned = sum(x.numel for x in layout.slices_in(start, stop))  # the parameters' elements in this shard
    home = {"none": DEVICE, "cpu": CPU, "nvme": NVME}[s.offload_optimizer]
    if s.stage < 3 or f.keep_full:
        out.add(Category.PARAM_4BIT, DEVICE, w * f.quantized_numel())
        out.add(working, DEVICE, w * (layout.padded_numel - f.quantized_numel()))
    else:
        tier = {"none": DEVICE, "cpu": CPU, "nvme": NVME}[s.offload_param]
        if tier == NVME and in_cpu + shard <= max_in_cpu:
            tier, in_cpu = CPU, in_cpu + shard
        out.add(Category.PARAM_4BIT, tier, w * f.quantized_numel(start, stop))
        out.add(working, tier, w * (shard - f.quantized_numel(start, stop)))
    if not f.trains:
        return in_cpu
    grad_tier = DEVICE if s.stage == 1 else CPU if home == NVME else home  # on nvme: in host memory
    out.add(Category.GRAD, grad_tier, w * (layout.padded_numel if s.stage == 1 else shard))
    separate = w == 2 or s.offload_optimizer != "none" or (s.stage == 3 and s.offload_param == "nvme")
    out.add(Category.PARAM32_MASTER, home, 4 * shard if separate else 0)
    stepped = owned if s.stage == 3 else shard
    out.add(Category.OPTIM_STATE, home, ADAM_STATE_BYTES * stepped)
    out.add(Category.OPTIM_STATE, CPU if home == NVME else home, STEP_BYTES * (1 if stepped else 0))
    return in_cpu


def deepspeed_estimate(numel: int, num_ranks: int, strategy: StrategySpec, largest_layer: int = 0) -> int | None:
    """Bytes per GPU that DeepSpeed's `estimate_zero2/3_model_states_mem_needs_all_cold` print for the
    same case (None below stage 2, which it does not estimate). Its accounting differs from the
    ledger's: it adds the step's fp32 gradient copy (4Ψ/N: zerodp reports it as a transient) and, at
    stage 3, 4 bytes per element of the largest layer (its gathered 16-bit parameters and gradients:
    zerodp's gathered units are transients too, bounded by stage3_max_live_parameters)."""
    s = strategy
    if s.stage == 2:
        return 2 * numel if s.offload_optimizer != "none" else 2 * numel + 18 * numel // num_ranks
    if s.stage == 3:
        largest = 4 * largest_layer
        if s.offload_optimizer != "none":
            return largest if s.offload_param != "none" else largest + 2 * numel // num_ranks
        return largest + 18 * numel // num_ranks if s.offload_param == "none" else None
    return None


def module_flats(module: "torch.nn.Module", stage: int, num_ranks: int, persistence_threshold: int = 100_000,
                 model_persistence_threshold: int = sys.maxsize, offload_param: str = "none",
                 trainable: set | None = None) -> list[Flat]:
    """The flat buffers a strategy builds for `module` (which may live on the meta device: only
    shapes are read), with one param group of `trainable` (default: every parameter that requires
    grad) and, at stage 3, the units zero/units.py's `plan_units` chooses (the
    stage3_param_persistence_threshold and stage3_model_persistence_threshold given here)."""
    from zerodp.zero.units import full_numel, plan_units

    trains_ = (lambda p: p in trainable) if trainable is not None else (lambda p: p.requires_grad)

    def split(params: list, keep_full: bool) -> list[Flat]:
        trains = tuple(full_numel(p) for p in params if trains_(p))
        frozen = [p for p in params if not trains_(p)]
        quantized = tuple(is_quantized(p) for p in frozen)  # 4-bit weights (bitsandbytes) never train
        frozen_flat = Flat(tuple(full_numel(p) for p in frozen), False, keep_full, quantized * any(quantized),
                           sum(nbytes(t) for t in quant_state_tensors(frozen)))
        return [Flat(trains, True, keep_full)] * bool(trains) + [frozen_flat] * bool(frozen)

    if stage < 3:
        return split(list(module.parameters()), False)
    plan = plan_units(module, persistence_threshold, model_persistence_threshold)
    whole = num_ranks == 1 and offload_param == "none"  # nothing to shard across
    flats = [f for _, _, params in plan.units for f in split(params, whole)]
    return flats + split(plan.persistent, True)  # the persistent unit stays whole


def buffer_bytes(module: "torch.nn.Module") -> int:
    """Bytes of the module's buffers (kept whole, in their own dtype, on every rank)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())
