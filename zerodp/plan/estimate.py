"""Model states per rank for every ZeRO strategy, before anything runs: numbers in, numbers out.

The bytes are the memory ledger's (zerodp/memory.py) by category and tier, from the same partition
arithmetic the strategies allocate with (zero/layout.py's `group_layout`), so a prediction and the
ledger of the same run agree (tests/test_estimate.py). What this module does not predict yet:
activations and transient buffers (gathered stage-3 units, gradient buckets, the step's fp32
gradient copy); `zerodp estimate` says so beside its figures.

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
offload_param.max_in_cpu elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerodp.memory import CPU, DEVICE, NVME, Category
from zerodp.zero.layout import group_layout

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq in fp32, per element
STEP_BYTES = 4  # torch's `step`: a 0-dim fp32 tensor per optimizer tensor


@dataclass(frozen=True)
class Strategy:
    """A ZeRO configuration as the estimator sees it."""

    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    dtype: str = "bf16"

    def describe(self) -> str:
        offload = [f"{what} -> {device}" for what, device in (("optimizer", self.offload_optimizer),
                                                               ("params", self.offload_param)) if device != "none"]
        return f"stage {self.stage}" + (f", offload {', '.join(offload)}" if offload else "")


def every_strategy(dtype: str = "bf16") -> list[Strategy]:
    """Every strategy zerodp runs: stage 0; stages 1-2 x optimizer offload; stage 3 x optimizer
    offload x parameter offload."""
    out = [Strategy(0, dtype=dtype)]
    out += [Strategy(s, o, dtype=dtype) for s in (1, 2) for o in OFFLOAD_DEVICES]
    out += [Strategy(3, o, p, dtype=dtype) for o in OFFLOAD_DEVICES for p in OFFLOAD_DEVICES]
    return out


@dataclass
class ModelStates:
    """Bytes per rank by (category, tier), and the `Strategy` they are for."""

    strategy: Strategy
    held: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, category: Category, tier: str, num_bytes: int) -> None:
        if num_bytes:
            key = (category.value, tier)
            self.held[key] = self.held.get(key, 0) + num_bytes

    def bytes(self, tier: str | None = None) -> int:
        """Total bytes, or those of one tier."""
        return sum(b for (_, t), b in self.held.items() if tier is None or t == tier)


def model_states(numel: int, num_ranks: int, strategy: Strategy, rank: int = 0,
                 param_max_in_cpu: int = 1_000_000_000) -> ModelStates:
    """Model-state bytes of `rank` (default 0, which holds the most: padding sits on the last ranks)
    for `numel` trainable elements in one flat group, trained with Adam on `num_ranks` ranks (see
    [Note: the model-state arithmetic]). `param_max_in_cpu`: offload_param.max_in_cpu, the shard
    elements parameter offload to nvme keeps in host memory (DeepSpeed's default)."""
    s, w = strategy, DTYPES[strategy.dtype]
    out = ModelStates(s)
    layout = group_layout([numel], num_ranks)
    shard = layout.shard_numel
    start, _ = layout.owned_range(rank)
    owned_elements = max(0, min(shard, numel - start))  # the parameters' elements in this rank's shard
    home = {"none": DEVICE, "cpu": CPU, "nvme": NVME}[s.offload_optimizer]
    working = Category.PARAM16 if w == 2 else Category.PARAM32_MASTER
    if s.stage == 0:
        out.add(working, DEVICE, w * numel)
        out.add(Category.GRAD, DEVICE, w * numel)
        stepped, master_elements, master_tier = numel, numel if w == 2 else 0, DEVICE
    else:
        param_elements = shard if s.stage == 3 else layout.padded_numel
        param_tier = {"none": DEVICE, "cpu": CPU, "nvme": NVME}[s.offload_param] if s.stage == 3 else DEVICE
        if param_tier == NVME and param_elements <= param_max_in_cpu:
            param_tier = CPU
        out.add(working, param_tier, w * param_elements)
        grad_tier = DEVICE if s.stage == 1 else CPU if home == NVME else home  # on nvme: in host memory
        out.add(Category.GRAD, grad_tier, w * (layout.padded_numel if s.stage == 1 else shard))
        stepped = owned_elements if s.stage == 3 else shard
        separate = w == 2 or s.offload_optimizer != "none" or (s.stage == 3 and s.offload_param == "nvme")
        master_elements, master_tier = (shard if separate else 0), home
    out.add(Category.PARAM32_MASTER, master_tier, 4 * master_elements)
    out.add(Category.OPTIM_STATE, home, ADAM_STATE_BYTES * stepped)
    out.add(Category.OPTIM_STATE, CPU if home == NVME else home, STEP_BYTES * (1 if stepped else 0))
    return out


def deepspeed_estimate(numel: int, num_ranks: int, strategy: Strategy, largest_layer: int = 0) -> int | None:
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


def estimate_rows(numel: int, num_ranks: int, dtype: str, largest_layer: int = 0) -> list[dict]:
    """One plain-data row per strategy (`zerodp estimate --json`): model states on the device, in host
    memory and on NVMe, per rank, and DeepSpeed's figure beside. `peak_bytes` is None: without a model
    there are no activations or transients to add."""
    rows = []
    for s in every_strategy(dtype):
        states = model_states(numel, num_ranks, s)
        rows.append({"stage": s.stage, "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                     "activation_checkpointing": None, "dtype": dtype, "world_size": num_ranks,
                     "model_states_bytes": states.bytes(DEVICE), "peak_bytes": None, "host_bytes": states.bytes(CPU),
                     "nvme_bytes": states.bytes(NVME), "by_category": {f"{c} ({t})": b for (c, t), b in states.held.items()},
                     "deepspeed_bytes": deepspeed_estimate(numel, num_ranks, s, largest_layer),
                     "strategy": s.describe()})
    return rows
