"""`zerodp plan`: the configs that fit a cluster, ranked by predicted step time.

    result = plan(workload("demo"), gpu_cluster("h100", nodes=2), seq_len=2048, global_batch=512)
    result.candidates[0].ds_config(result.global_batch)    # the fastest that fits, as DeepSpeed JSON

For every strategy (stage, offload) and activation checkpointing policy the search finds the largest
micro-batch that fits: per-rank samples (global batch / ranks) split into micro-batch x accumulation,
each micro-batch size a divisor of them, its peak from a simulation of zerodp's own engine on fake
tensors at that world size (zerodp/plan/simulate.py: exact for model states, activations and
transients), binary-searched since the peak grows with the micro-batch. The largest micro-batch that
fits is the fastest one of its strategy: the same FLOPs in fewer micro-batches, and at stages 2-3
less communication. Its step time comes from zerodp/plan/cluster.py's model, fed with the
collectives the simulation ran and the FLOPs it counted. A candidate another one dominates (the same
strategy with checkpointing when it already fits the largest micro-batch without; more sharding or
offload than a cheaper strategy that already fits it), or whose step could not beat the fastest found
even with every sample in one micro-batch and no communication, is not simulated, unless `exhaustive`. Bucket
sizes follow a rule (`bucket_sizes`), they are not searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from zerodp.memory import CPU, DEVICE, NVME
from zerodp.plan.cluster import Cluster, StepTime, Work, step_time
from zerodp.plan.engines import EngineFactory
from zerodp.plan.model_states import DTYPES, StrategySpec, buffer_bytes, flat_states, module_flats, strategy_config
from zerodp.plan.workload import Workload
from zerodp.plan.zeropp import ZeroPlusPlus
from zerodp.sizes import decimal_size

DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size, elements


def bucket_sizes(numel: int) -> dict:
    """The bucket key a plan writes: DeepSpeed's default reduce_bucket_size, capped at a quarter of the
    model so that stage 2's reduction runs in >= 4 buckets from backward (a bucket holding every
    gradient would keep stage 2 at stage 1's peak), and at least 1M elements (fewer, longer
    collectives). No allgather_bucket_size: zerodp's stages 1-2 gather in place, without a buffer it bounds."""
    return {"reduce_bucket_size": max(1_000_000, min(DEFAULT_BUCKET, numel // 4))}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    """A config that fits: its strategy, checkpointing policy, batch split, predicted peaks per rank
    (device, host) and step time."""

    strategy: StrategySpec
    activation_checkpointing: str
    micro_batch: int
    accumulation: int
    peak_bytes: int
    host_peak_bytes: int | None
    time: StepTime
    comm_bytes: int
    zero: dict = field(default_factory=dict)
    sequence_parallel: int = 1  # ranks per sequence (Ulysses; zerodp/plan/sequence.py)
    zeropp: str = ""  # the ZeRO++ features it runs ("qwZ + qgZ"; zerodp/plan/zeropp.py), "" when none

    def describe(self) -> str:
        ckpt = "" if self.activation_checkpointing == "none" else f", {self.activation_checkpointing} checkpointed"
        return f"{self.strategy.describe()}{f', {self.zeropp}' if self.zeropp else ''}{ckpt}"

    def ds_config(self, global_batch: int, nvme_path: str = "/local_nvme") -> dict:
        """The DeepSpeed JSON config (a dict) of this candidate, for `global_batch` samples per step."""
        config = strategy_config(self.strategy, self.micro_batch, self.accumulation)
        config["train_batch_size"] = global_batch
        config["zero_optimization"].update(self.zero)
        if self.sequence_parallel > 1:
            config["sequence_parallel_size"] = self.sequence_parallel
        for key in ("offload_optimizer", "offload_param"):
            section = config["zero_optimization"].get(key)
            if section and section["device"] == "nvme":
                section["nvme_path"] = nvme_path
        return config

    def as_dict(self) -> dict:
        s = self.strategy
        return {"stage": s.stage, "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                "activation_checkpointing": self.activation_checkpointing, "dtype": s.dtype,
                "micro_batch": self.micro_batch, "gradient_accumulation_steps": self.accumulation,
                "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "comm_bytes": self.comm_bytes, "step_seconds": self.time.as_dict(), "strategy": self.describe(),
                "zero_optimization": dict(self.zero), "sequence_parallel": self.sequence_parallel}


@dataclass
class Plan:
    """The candidates that fit, fastest first, and why the others were left out."""

    cluster: Cluster
    seq_len: int
    global_batch: int
    candidates: list[Candidate]
    left_out: list[dict]  # {"strategy", "activation_checkpointing", "why"}
    simulations: int = 0
    sequence_parallel: int = 1  # ranks per sequence of every candidate
    sequence_note: str = ""  # why sequence parallelism was proposed (or tried in vain); "" when not

    def why(self) -> str:
        """One line: why the first candidate beats the second (and why the sequence is split, when it is)."""
        note = f"{self.sequence_note}; " if self.sequence_note else ""
        if not self.candidates:
            return note + "nothing fits: " + "; ".join(f"{x['strategy']}: {x['why']}" for x in self.left_out[:3])
        return note + self._why_first()

    def _why_first(self) -> str:
        best = self.candidates[0]
        head = (f"{best.describe()} fits at micro-batch {best.micro_batch} (peak {decimal_size(best.peak_bytes)} "
                f"of {decimal_size(self.cluster.usable_bytes)} usable)")
        if len(self.candidates) == 1:
            return head + "; nothing else fits"
        return f"{head}; {self.candidates[1].describe()} {_slower_because(best, self.candidates[1])}"


def _slower_because(best: Candidate, other: Candidate) -> str:
    """`other` is slower than `best`: by how much, and the part of the step that makes most of it."""
    a, b = best.time, other.time
    ratio = b.total / a.total - 1
    slower = f"would take {100 * ratio:.0f}% longer" if ratio >= 0.005 else "is as fast (within 0.5%)"
    deltas = {"compute": b.compute - a.compute, "communication": b.exposed_communication - a.exposed_communication,
              "optimizer": b.optimizer - a.optimizer, "offload": b.offload - a.offload}
    part, delta = max(deltas.items(), key=lambda kv: kv[1])
    if delta <= 0:
        return slower
    if part == "compute" and other.activation_checkpointing != best.activation_checkpointing:
        reason = f"recomputing checkpointed activations (+{delta:.3g} s)"
    elif part == "compute":
        reason = f"micro-batch {other.micro_batch} x {other.accumulation} steps instead of {best.micro_batch} x " \
                 f"{best.accumulation} (+{delta:.3g} s)"
    elif part == "communication":
        ratio = other.comm_bytes / max(best.comm_bytes, 1)
        reason = f"{ratio:.1f}x the communication per step (+{delta:.3g} s exposed)"
        if other.peak_bytes < best.peak_bytes:
            reason += " for memory you do not need"
    elif part == "optimizer":
        reason = f"the optimizer step on {'the CPU' if other.strategy.offload_optimizer != 'none' else 'more elements'} " \
                 f"(+{delta:.3g} s)"
    else:
        reason = f"offload transfers (+{delta:.3g} s)"
    return f"{slower}: {reason}"


def plan_strategies(cluster: Cluster, dtype: str) -> list[StrategySpec]:
    """The strategies a plan tries: stages 0-3, and on GPUs optimizer offload from stage 1 and parameter
    offload at stage 3 (to the CPU; to NVMe when the nodes have it), cheapest first."""
    out = [StrategySpec(s, dtype=dtype) for s in range(4)]
    if cluster.device == "cpu":
        return out  # the device is host memory: offloading to it saves nothing
    out += [StrategySpec(1, "cpu", dtype=dtype), StrategySpec(2, "cpu", dtype=dtype), StrategySpec(3, "cpu", dtype=dtype),
            StrategySpec(3, "cpu", "cpu", dtype=dtype)]
    if cluster.nvme_bytes:
        out += [StrategySpec(2, "nvme", dtype=dtype), StrategySpec(3, "nvme", dtype=dtype), StrategySpec(3, "nvme", "nvme", dtype=dtype)]
    return out


def _dominators(s: StrategySpec, policy: str) -> list[tuple[StrategySpec, str]]:
    """Candidates that, fitting the largest micro-batch, are at least as fast as (s, policy)."""
    out = [(s, "none")] if policy != "none" else []
    if "nvme" in (s.offload_optimizer, s.offload_param):
        out.append((s.device_twin(), policy))
    if s.offload_param != "none":
        out.append((replace(s, offload_param="none"), policy))
    elif s.offload_optimizer != "none":
        out.append((StrategySpec(s.stage, dtype=s.dtype), policy))
    if s.stage in (2, 3):
        out.append((replace(s, stage=s.stage - 1, offload_param="none"), policy))
    return out


def plan(work: Workload, cluster: Cluster, seq_len: int, global_batch: int, dtype: str = "bf16",
         policies: tuple[str, ...] = ("none", "blocks"), exhaustive: bool = False,
         progress: Callable[[str], None] | None = None, initialize: EngineFactory | None = None,
         sequence_parallel: int = 1, zeropp: ZeroPlusPlus = ZeroPlusPlus()) -> Plan:
    """Search the configs that fit `cluster` for `work` at `seq_len` tokens and `global_batch`
    samples per optimizer step (a multiple of the world size; ValueError otherwise), ranked by
    predicted step time. `exhaustive`: simulate dominated candidates too (the planner bench measures
    every candidate). `progress(line)` hears of each simulation. `initialize` builds the simulated
    engines (default: zerodp.initialize; zerodp/plan/engines.py). `sequence_parallel` S: every
    candidate splits each sequence over S ranks (Ulysses); at 1, when nothing fits but some strategy's
    model states do, the sequence is what does not fit, and the plan tries S = 2, 4, 8, ... (sizes the
    ranks and the model's heads take) and returns the smallest that fits (`sequence_note` says why).
    `zeropp`: the ZeRO++ keys the stage-3 candidates run with (their collectives' bytes are the
    runtime's quantized ones, zerodp/plan/zeropp.py); not with sequence parallelism (the runtime refuses it)."""
    world = cluster.world_size
    if global_batch % world:
        raise ValueError(f"--global-batch {global_batch}: not a multiple of the {world} ranks "
                         f"({cluster.gpus_per_node} per node x {cluster.nodes} nodes)")
    module = work.meta()
    if not work.feeds(module):
        raise ValueError(f"MODEL {work.spec!r}: its input is unknown (not a causal LM, no estimate_inputs), so its "
                         "activations cannot be simulated")
    _check_sequence_parallel(sequence_parallel, cluster, module, work.spec, seq_len)
    if zeropp and sequence_parallel > 1:
        raise ValueError(f"ZeRO++ ({zeropp.describe()}) with sequence parallel {sequence_parallel}: the runtime does not "
                         "build ZeRO++ with sequence parallelism")
    search = _Search(work, module, cluster, seq_len, global_batch * sequence_parallel // world, dtype,
                     progress or (lambda line: None), initialize, sequence_parallel, zeropp)
    reached: set[tuple[StrategySpec, str]] = set()
    left_out: list[dict] = []
    found: list[Candidate] = []
    for policy in policies:
        for s in plan_strategies(cluster, dtype):
            dominator = next((d for d in _dominators(s, policy) if d in reached), None)
            if dominator is not None and not exhaustive:
                left_out.append(_left(s, policy, f"not simulated: {dominator[0].describe()} "
                                      f"({dominator[1]}) fits micro-batch {search.per_rank} and does less work"))
                reached.add((s, policy))  # what it would dominate, its dominator does too
                continue
            fastest = search.lower_bound(s, policy)
            if found and not exhaustive and fastest >= min(c.time.total for c in found):
                left_out.append(_left(s, policy, f"not simulated: {fastest:.3g} s at best (one micro-batch, no "
                                      "communication), slower than a candidate already found"))
                continue
            result = search.best(s, policy)
            if isinstance(result, str):
                left_out.append(_left(s, policy, result))
                continue
            found.append(result)
            if result.micro_batch == search.per_rank:
                reached.add((s, policy))
    found.sort(key=lambda c: c.time.total)
    result = Plan(cluster, seq_len, global_batch, found, left_out, search.simulations, sequence_parallel)
    if not found and sequence_parallel == 1 and search.too_long and not zeropp:
        return _split_the_sequence(result, work, module, search.too_long, policies, dtype, exhaustive, progress,
                                   initialize)
    return result


def _check_sequence_parallel(sp: int, cluster: Cluster, module: "torch.nn.Module", model: str, seq_len: int) -> None:
    """ValueError naming --sequence-parallel when the ranks, the model's heads or the sequence do not take `sp`."""
    from zerodp.plan.sequence import model_heads, sequence_parallel_problems

    problems = sequence_parallel_problems(sp, cluster.world_size, model_heads(module), model,
                                          f"the {{}} ranks (--gpus-per-node {cluster.gpus_per_node} x --nodes {cluster.nodes})")
    if seq_len % sp:
        problems.append(f"--seq-len {seq_len} does not divide by --sequence-parallel {sp}; use {seq_len + -seq_len % sp}")
    if problems:
        raise ValueError("; ".join(problems))


def _split_the_sequence(unsplit: Plan, work: Workload, module: "torch.nn.Module", too_long: list[tuple],
                        policies: tuple[str, ...], dtype: str, exhaustive: bool,
                        progress: Callable[[str], None] | None, initialize: EngineFactory | None) -> Plan:
    """Nothing fits at S = 1, though the model states of the strategies in `too_long` (describe, policy,
    model-state bytes, peak at micro-batch 1) do: plan with S = 2, 4, 8, ... and return the first plan
    that fits, saying why; else `unsplit`, saying which sizes were tried."""
    from zerodp.plan.sequence import model_heads, sequence_parallel_sizes

    c, seq_len = unsplit.cluster, unsplit.seq_len
    strategy, policy, states, peak = min(too_long, key=lambda t: t[3])
    why = (f"the sequence, not the model, does not fit: {strategy} ({policy} checkpointed) holds "
           f"{decimal_size(states)} of model states, but one sequence of {seq_len} tokens peaks at "
           f"{decimal_size(peak)} of {decimal_size(c.usable_bytes)} usable")
    heads = model_heads(module)
    sizes = [] if heads is None else [s for s in sequence_parallel_sizes(c.world_size, heads) if seq_len % s == 0]
    simulations = unsplit.simulations
    for size in sizes:
        (progress or (lambda line: None))(f"{why}: trying sequence parallel {size}")
        split = plan(work, c, seq_len, unsplit.global_batch, dtype, policies, exhaustive, progress, initialize, size)
        simulations += split.simulations
        if split.candidates:
            split.simulations = simulations
            smaller = sizes[:sizes.index(size)]
            split.sequence_note = (f"{why}; sequence_parallel_size {size} (Ulysses: each rank holds {seq_len // size} "
                                   "of the tokens) is the smallest that fits" + (f" ({smaller} do not)" if smaller else ""))
            return split
    unsplit.simulations = simulations
    unsplit.sequence_note = f"{why}; sequence parallelism {sizes} did not fit either" if sizes else \
        f"{why}; no sequence_parallel_size splits it (the ranks and heads take none of 2, 4, 8, ..., or the model is " \
        "not a Hugging Face model)"
    return unsplit


def _left(s: StrategySpec, policy: str, why: str) -> dict:
    return {"strategy": s.describe(), "stage": s.stage, "offload_optimizer": s.offload_optimizer,
            "offload_param": s.offload_param, "activation_checkpointing": policy, "why": why}


@dataclass
class _Search:
    """One plan's simulations and FLOP counts, cached."""

    work: Workload
    module: "torch.nn.Module"
    cluster: Cluster
    seq_len: int
    per_rank: int  # samples per rank per optimizer step
    dtype: str
    say: Callable[[str], None]
    initialize: EngineFactory | None = None  # builds the simulated engines
    sp: int = 1  # ranks per sequence (Ulysses)
    zeropp: ZeroPlusPlus = ZeroPlusPlus()  # the stage-3 candidates' ZeRO++ keys
    simulations: int = 0
    too_long: list = field(default_factory=list)  # (strategy, policy, model states, peak): states fit, micro-batch 1 not
    _sims: dict = field(default_factory=dict)
    _flops: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def best(self, s: StrategySpec, policy: str) -> Candidate | str:
        """The candidate of (s, policy) at the largest micro-batch that fits, or why none does."""
        c, world = self.cluster, self.cluster.world_size
        states = flat_states(module_flats(self.module, s.stage, world, offload_param=s.offload_param), world, s,
                             buffer_bytes=buffer_bytes(self.module))
        if states.bytes(DEVICE) > c.usable_bytes:
            return f"model states alone need {decimal_size(states.bytes(DEVICE))} of {decimal_size(c.usable_bytes)}"
        host_need = (states.bytes(CPU) + (states.bytes(DEVICE) if c.device == "cpu" else 0)) * c.gpus_per_node
        if c.device != "cpu" and host_need > c.host_memory_bytes:
            return f"offloaded states need {decimal_size(host_need)} of host memory per node, more than " \
                   f"{decimal_size(c.host_memory_bytes)}"
        if states.bytes(NVME) * c.gpus_per_node > c.nvme_bytes and states.bytes(NVME):
            return f"states on NVMe need {decimal_size(states.bytes(NVME) * c.gpus_per_node)} per node, more than " \
                   f"{decimal_size(c.nvme_bytes)}"
        options = divisors(self.per_rank)
        largest = self._simulate(s, policy, options[-1])  # with memory to spare, the one simulation needed
        if isinstance(largest, str):
            return largest
        low, high, best = 0, len(options) - 2, None
        if self._fits(s, largest):
            low, best = len(options), options[-1]
        while low <= high:  # the peak grows with the micro-batch: the largest that fits
            mid = (low + high) // 2
            sim = self._simulate(s, policy, options[mid])
            if isinstance(sim, str):
                return sim
            if self._fits(s, sim):
                best, low = options[mid], mid + 1
            else:
                high = mid - 1
        if best is None:
            sim = self._simulate(s, policy, options[0])
            self.too_long.append((s.describe(), policy, states.bytes(DEVICE), sim.peak[DEVICE].bytes))
            return f"micro-batch 1 peaks at {decimal_size(sim.peak[DEVICE].bytes)} of {decimal_size(c.usable_bytes)}"
        return self._candidate(s, policy, best)

    def _fits(self, s: StrategySpec, sim: "Simulation") -> bool:
        c = self.cluster
        if sim.peak[DEVICE].bytes > c.usable_bytes:
            return False
        host = sim.peak[CPU].bytes
        return c.device == "cpu" or "nvme" in (s.offload_optimizer, s.offload_param) or \
            host * c.gpus_per_node <= c.host_memory_bytes

    def _simulate(self, s: StrategySpec, policy: str, micro_batch: int) -> "Simulation | str":
        from zerodp.plan.simulate import simulate_strategy

        accumulation = min(self.per_rank // micro_batch, 2)  # a third micro-batch repeats the second
        key = (s.device_twin(), policy, micro_batch, accumulation)
        if key not in self._sims:
            self.simulations += 1
            self.say(f"simulating {s.describe()}, checkpointing {policy}, micro-batch {micro_batch}")
            zero = self._zero(s)
            device = "cpu" if self.cluster.device == "cpu" else "meta"
            try:
                self._sims[key] = simulate_strategy(self.work, s, self.cluster.world_size, micro_batch, self.seq_len,
                                                    policy, device, accumulation=accumulation, zero=zero,
                                                    initialize=self.initialize, sequence_parallel=self.sp)
            except ValueError:
                raise
            except Exception as err:  # noqa: BLE001 - the model's own code under fake tensors
                self._sims[key] = f"the simulated step failed: {type(err).__name__}: {str(err).strip()[:200]}"
        return self._sims[key]

    def flops(self, policy: str, micro_batch: int) -> float:
        """FLOPs of one micro-batch's forward and backward (recomputation included), counted on meta; with
        S ranks per sequence each does 1/S of them ([Note: the estimator's sequence parallelism])."""
        key = (policy, micro_batch)
        if key not in self._flops:
            self._flops[key] = count_flops(self.work, micro_batch, self.seq_len, policy) / self.sp
        return self._flops[key]

    def lower_bound(self, s: StrategySpec, policy: str) -> float:
        """The step time (s, policy) cannot beat: every sample in one micro-batch, no communication."""
        return step_time(self._work(s, policy, self.per_rank, {}, {}), self.cluster).total

    def _work(self, s: StrategySpec, policy: str, micro_batch: int, comm_bytes: dict, comm_calls: dict) -> Work:
        w = DTYPES[s.dtype]
        shard = self.numel if s.stage == 0 else math.ceil(self.numel / self.cluster.world_size)
        return Work(self.flops(policy, micro_batch), self.per_rank // micro_batch, comm_bytes, comm_calls, shard,
                    w * shard, w * shard, s.offload_optimizer, s.offload_param, self.sp)

    def _candidate(self, s: StrategySpec, policy: str, micro_batch: int) -> Candidate:
        sim = self._simulate(s, policy, micro_batch)
        accumulation = self.per_rank // micro_batch
        extra = accumulation - min(accumulation, 2)  # micro-batches like the simulated non-last one
        micro = sim.micro_comm
        comm_bytes = {op: b + extra * (micro.bytes.get(op, 0) if micro else 0) for op, b in sim.step_comm.bytes.items()}
        comm_calls = {op: n + extra * (micro.calls.get(op, 0) if micro else 0) for op, n in sim.step_comm.calls.items()}
        work = self._work(s, policy, micro_batch, comm_bytes, comm_calls)
        nvme = "nvme" in (s.offload_optimizer, s.offload_param)
        return Candidate(s, policy, micro_batch, accumulation, sim.peak[DEVICE].bytes,
                         None if nvme else sim.peak[CPU].bytes, step_time(work, self.cluster),
                         int(sum(comm_bytes.values())), self._zero(s), self.sp,
                         self.zeropp.describe() if self.zeropp.zero_keys(s) else "")

    def _zero(self, s: StrategySpec) -> dict:
        """The zero_optimization keys `s` is simulated and written with: bucket sizes, ZeRO++'s at stage 3."""
        return {**bucket_sizes(self.numel), **self.zeropp.zero_keys(s)}


def count_flops(work: Workload, micro_batch: int, seq_len: int, policy: str = "none") -> float:
    """FLOPs of one forward and backward of `work`'s model on one micro-batch (built on meta, no
    memory), with activation checkpointing `policy`'s recomputation: torch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zerodp import checkpointing
    from zerodp.plan.simulate import unpacked_rows

    model = work.meta()
    if policy != "none":
        checkpointing.apply(model, "blocks", selective=policy == "selective")
    args, kwargs = work.inputs(model, micro_batch, seq_len, torch.device("meta"))
    with FlopCounterMode(display=False) as counter, unpacked_rows():
        out = model(*args, **kwargs)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    return float(counter.get_total_flops())
