"""Memory per rank for every ZeRO strategy, before anything runs.

The model-state arithmetic (`model_states`, `flat_states`) is pure: numbers in, numbers out.
`module_flats` reads a model's shapes into the flat buffers the strategies would build (the model may
be on the meta device: no weights). The bytes are the memory ledger's (zerodp/memory.py) by category
and tier, from the same partition arithmetic the strategies allocate with (zero/layout.py's
`group_layout`), so a prediction and the ledger of the same run agree (tests/test_estimate.py). The
peak with activations and transient buffers comes from simulating the strategy's training step
(`estimate_rows` with a `Workload`; zerodp/plan/simulate.py). `workload` names the models
`zerodp estimate` takes.

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

import sys
from dataclasses import dataclass, field
from typing import Callable

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

    def device_twin(self) -> "Strategy":
        """The strategy whose device side runs the same code: nvme offload's is cpu offload's."""
        return Strategy(self.stage, "cpu" if self.offload_optimizer == "nvme" else self.offload_optimizer,
                        "cpu" if self.offload_param == "nvme" else self.offload_param, self.dtype)

    def describe(self) -> str:
        offload = [f"{what} -> {device}" for what, device in (("optimizer", self.offload_optimizer),
                                                               ("params", self.offload_param)) if device != "none"]
        return f"stage {self.stage}" + (f", offload {', '.join(offload)}" if offload else "")


ACTIVATION_CHECKPOINTING = ("none", "blocks", "selective")
"""The estimator's activation checkpointing policies (zerodp.checkpointing.apply)."""


def strategy_config(s: Strategy, micro_batch: int = 1, accumulation: int = 1) -> dict:
    """The DeepSpeed JSON config (a dict) that trains with `s`: AdamW, this micro-batch and
    gradient accumulation (default none); nvme offload needs an nvme_path added."""
    zero: dict = {"stage": s.stage}
    for key, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if device != "none":
            zero[key] = {"device": device}
    precision = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}, "fp32": {}}[s.dtype]
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero, **precision}


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


@dataclass(frozen=True)
class Flat:
    """A flat buffer a strategy allocates: its parameters' element counts, whether the optimizer
    trains them, and (stage 3) whether it stays whole (a persistent unit, or nothing to shard)."""

    numels: tuple[int, ...]
    trains: bool = True
    keep_full: bool = False


def model_states(numel: int, num_ranks: int, strategy: Strategy, rank: int = 0,
                 param_max_in_cpu: int = 1_000_000_000) -> ModelStates:
    """Model-state bytes of `rank` (default 0, which holds the most: padding sits on the last ranks)
    for `numel` trainable elements in one flat group, trained with Adam on `num_ranks` ranks (see
    [Note: the model-state arithmetic]). `param_max_in_cpu`: offload_param.max_in_cpu, the shard
    elements parameter offload to nvme keeps in host memory (DeepSpeed's default)."""
    return flat_states([Flat((numel,))], num_ranks, strategy, rank, param_max_in_cpu)


def flat_states(flats: list[Flat], num_ranks: int, strategy: Strategy, rank: int = 0,
                param_max_in_cpu: int = 1_000_000_000, buffer_bytes: int = 0) -> ModelStates:
    """Model-state bytes of `rank` for these flat buffers: at stages 0-2 the param groups (frozen
    parameters in flats that do not train, held whole), at stage 3 every unit's trainable and frozen
    flat in unit order; plus `buffer_bytes` of module buffers."""
    s, w = strategy, DTYPES[strategy.dtype]
    out = ModelStates(s)
    out.add(Category.BUFFER, DEVICE, buffer_bytes)
    working = Category.PARAM16 if w == 2 else Category.PARAM32_MASTER
    if s.stage == 0:
        trained = [n for f in flats if f.trains for n in f.numels]
        out.add(working, DEVICE, w * sum(n for f in flats for n in f.numels))
        out.add(Category.GRAD, DEVICE, w * sum(trained))
        out.add(Category.PARAM32_MASTER, DEVICE, 4 * sum(trained) if w == 2 else 0)
        out.add(Category.OPTIM_STATE, DEVICE, ADAM_STATE_BYTES * sum(trained) + STEP_BYTES * len(trained))
        return out
    in_cpu = 0  # stage 3, parameters offloaded to nvme: shard elements kept in host memory so far
    for f in flats:
        if s.stage < 3 and not f.trains:
            out.add(working, DEVICE, w * sum(f.numels))
            continue
        in_cpu = _add_flat(out, f, num_ranks, s, rank, param_max_in_cpu, in_cpu)
    return out


def _add_flat(out: ModelStates, f: Flat, num_ranks: int, s: Strategy, rank: int, max_in_cpu: int,
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
    if s.stage < 3:
        out.add(working, DEVICE, w * layout.padded_numel)
    elif f.keep_full:
        out.add(working, DEVICE, w * layout.padded_numel)
    else:
        tier = {"none": DEVICE, "cpu": CPU, "nvme": NVME}[s.offload_param]
        if tier == NVME and in_cpu + shard <= max_in_cpu:
            tier, in_cpu = CPU, in_cpu + shard
        out.add(working, tier, w * shard)
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


def estimate_rows(numel: int, num_ranks: int, dtype: str, largest_layer: int = 0,
                  module: "torch.nn.Module | None" = None, work: "Workload | None" = None, micro_batch: int = 1,
                  seq_len: int = 0, policies: tuple[str, ...] = ("none",),
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """One plain-data row per strategy (`zerodp estimate --json`) and activation checkpointing policy:
    model states on the device, in host memory and on NVMe, per rank (rank 0), DeepSpeed's figure
    beside, and with `work` (whose `module` was built on the meta device) the peak of one simulated
    training step at this micro-batch and sequence length (zerodp/plan/simulate.py); else one flat
    group of `numel` and `peak_bytes` None. `progress(line)` hears of each simulation."""
    simulated: dict = {}
    strategies = every_strategy(dtype)
    runs = len(policies) * len({s.device_twin() for s in strategies})
    rows = []
    for policy in policies if work is not None else (None,):
        for s in strategies:
            if module is None:
                states = model_states(numel, num_ranks, s)
            else:
                flats = module_flats(module, s.stage, num_ranks, offload_param=s.offload_param)
                states = flat_states(flats, num_ranks, s, buffer_bytes=buffer_bytes(module))
            row = {"stage": s.stage, "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                   "activation_checkpointing": policy, "dtype": dtype, "world_size": num_ranks,
                   "micro_batch": micro_batch if work is not None else None, "seq_len": seq_len if work is not None else None,
                   "model_states_bytes": states.bytes(DEVICE), "peak_bytes": None, "host_bytes": states.bytes(CPU),
                   "nvme_bytes": states.bytes(NVME), "by_category": {f"{c} ({t})": b for (c, t), b in states.held.items()},
                   "deepspeed_bytes": deepspeed_estimate(numel, num_ranks, s, largest_layer),
                   "strategy": s.describe()}
            if work is not None:
                row.update(_peak_fields(simulated, work, s, num_ranks, micro_batch, seq_len, policy, runs, progress))
            rows.append(row)
    return rows


def _peak_fields(cache: dict, work: "Workload", s: Strategy, num_ranks: int, micro_batch: int, seq_len: int,
                 policy: str, runs: int, progress: Callable[[str], None] | None) -> dict:
    """A row's simulated fields, simulating the device twin of `s` once (`cache`). A model whose step
    cannot run on fake tensors gets `peak_error` instead (ValueError, a bad input, is raised)."""
    from zerodp.plan.simulate import SimulationUnavailable, simulate_strategy

    say = progress or (lambda line: None)
    twin = (s.device_twin(), policy)
    if twin not in cache:
        say(f"simulating {len(cache) + 1}/{runs}: {s.describe()}, activation checkpointing {policy}")
        try:
            cache[twin] = simulate_strategy(work, s, num_ranks, micro_batch, seq_len, policy)
        except (ValueError, SimulationUnavailable):
            raise
        except Exception as err:  # noqa: BLE001 - the model's own code under fake tensors: reported per row
            cache[twin] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            say(f"  the simulated step failed ({cache[twin]}); model states only for it")
    sim = cache[twin]
    if isinstance(sim, str):
        return {"peak_error": sim}
    nvme = "nvme" in (s.offload_optimizer, s.offload_param)
    return {"peak_bytes": sim.peak[DEVICE].bytes, "peak_phase": sim.peak[DEVICE].phase,
            "activations_bytes": sim.activations, "host_peak_bytes": None if nvme else sim.peak[CPU].bytes}


@dataclass(frozen=True)
class Workload:
    """A model to estimate: `build()` makes it (on whatever device the caller's `torch.device`
    context sets, meta or fake: shapes only), `inputs(model, micro_batch, seq_len, device)` one
    micro-batch as (args, kwargs) whose forward returns the loss or an output with `.loss` (None: this
    model's input is unknown, so only its model states are estimated), `max_seq_len` the longest
    input it takes (None: unknown)."""

    spec: str
    build: Callable[[], "torch.nn.Module"]
    inputs: Callable[["torch.nn.Module", int, int, "torch.device"], tuple[tuple, dict]] | None = None
    max_seq_len: int | None = None
    input_method: str | None = None  # the method a built module needs for `inputs` to feed it

    def meta(self) -> "torch.nn.Module":
        """The model on the meta device: no weights are allocated or read."""
        import torch

        with torch.device("meta"):
            return self.build()

    def feeds(self, module: "torch.nn.Module") -> bool:
        """Whether `inputs` can feed this built module (else only its model states are estimated)."""
        return self.inputs is not None and (self.input_method is None or hasattr(module, self.input_method))


def workload(spec: str) -> Workload:
    """The workload `spec` names: "demo" (the demo's GPT), "gpt:d_model=1024,n_layer=24,..." (the
    demo's GPT at other sizes: GPTConfig's fields, the rest as the demo's), a Hugging Face config
    file or model directory (config.json; transformers needed; a causal LM is fed token ids and
    labels), or "module:function" returning an nn.Module (fed by its `estimate_inputs(micro_batch,
    seq_len)` method when it has one, returning (args, kwargs)). ValueError naming the spec otherwise."""
    import importlib
    from pathlib import Path

    if spec == "demo" or spec.startswith("gpt:"):
        return _gpt_workload(spec)
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        return _hf_workload(path)
    module_name, _, function = spec.partition(":")
    if not function:
        raise ValueError(f"MODEL {spec!r}: expected demo, gpt:KEY=VALUE,..., a Hugging Face config (file or "
                         "directory) or module:function")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"MODEL {spec!r}: {err}") from None

    def build() -> "torch.nn.Module":
        import torch

        made = factory()
        if not isinstance(made, torch.nn.Module):
            raise ValueError(f"MODEL {spec!r}: {function}() returned a {type(made).__name__}, not an nn.Module")
        return made

    def inputs(module: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        import torch

        with torch.device(device):
            args, kwargs = module.estimate_inputs(micro_batch, seq_len)
        return tuple(args), dict(kwargs)

    return Workload(spec, build, inputs, input_method="estimate_inputs")


def _gpt_workload(spec: str) -> Workload:
    import dataclasses

    import torch

    from zerodp.demo import DEMO_DEFAULT, TinyGPT

    fields = {f.name: f.type for f in dataclasses.fields(DEMO_DEFAULT)}
    sizes = {}
    for item in filter(None, spec.partition(":")[2].split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value.strip().lstrip("-").replace(".", "", 1).isdigit():
            raise ValueError(f"MODEL {spec!r}: {item!r} is not KEY=NUMBER with KEY one of {', '.join(fields)}")
        sizes[key] = float(value) if "." in value else int(value)
    config = dataclasses.replace(DEMO_DEFAULT, **sizes)

    def inputs(_: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
        return (ids, ids), {}

    return Workload(spec, lambda: TinyGPT(config), inputs, config.seq_len)


def _hf_workload(path: "Path") -> Workload:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"MODEL {path}: a Hugging Face config needs transformers (pip install transformers)") from None
    if not path.exists() or (path.is_dir() and not (path / "config.json").is_file()):
        raise ValueError(f"MODEL {path}: no config.json there")
    import torch

    config = transformers.AutoConfig.from_pretrained(str(path))
    causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel

    def build() -> "torch.nn.Module":
        try:
            return auto.from_config(config)
        except ValueError as err:
            raise ValueError(f"MODEL {path}: transformers builds no model from its config "
                             f"(model_type {config.model_type!r}): {err}") from None

    def inputs(_: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
        return (), {"input_ids": ids, "labels": ids}

    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return Workload(str(path), build, inputs if causal else None, longest)


def meta_model(spec: str) -> "torch.nn.Module":
    """Build `spec` (see `workload`) on the meta device: no weights are allocated or read."""
    return workload(spec).meta()


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
        frozen = tuple(full_numel(p) for p in params if not trains_(p))
        return [Flat(trains, True, keep_full)] * bool(trains) + [Flat(frozen, False, keep_full)] * bool(frozen)

    if stage < 3:
        return split(list(module.parameters()), False)
    plan = plan_units(module, persistence_threshold, model_persistence_threshold)
    whole = num_ranks == 1 and offload_param == "none"  # nothing to shard across
    flats = [f for _, _, params in plan.units for f in split(params, whole)]
    return flats + split(plan.persistent, True)  # the persistent unit stays whole


def buffer_bytes(module: "torch.nn.Module") -> int:
    """Bytes of the module's buffers (kept whole, in their own dtype, on every rank)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())
