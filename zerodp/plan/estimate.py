"""Memory per rank for every ZeRO strategy, before anything runs: the rows of `zerodp estimate`.

Each row holds one strategy's model states by ledger category and tier (zerodp/plan/model_states.py: pure
arithmetic from the partition layout the strategies allocate with) and, given a `Workload`
(zerodp/plan/workload.py), the peak with activations and transient buffers from simulating the strategy's
training step on fake tensors (zerodp/plan/simulate.py); with Ulysses over S ranks, the rank's shard of
the sequence and its all-to-all bytes (zerodp/plan/sequence.py); with ZeRO++ (qwZ, qgZ, hpZ) at stage 3, the
collectives the runtime's own quantized code sends (zerodp/plan/zeropp.py); and the longest sequence that fits a
device (`longest_trainable_sequence`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from zerodp.memory import CPU, DEVICE, NVME
from zerodp.plan.engines import EngineFactory
from zerodp.plan.model_states import (DTYPES, StrategySpec, buffer_bytes, deepspeed_estimate, every_strategy,
                                      flat_states, model_states, module_flats)
from zerodp.plan.sequence import Longest, all_to_all_bytes, longest_sequence, model_heads
from zerodp.plan.simulate import SimulationUnavailable, simulate_strategy
from zerodp.plan.workload import Workload
from zerodp.plan.zeropp import ZeroPlusPlus

if TYPE_CHECKING:
    import torch


ACTIVATION_CHECKPOINTING = ("none", "blocks", "selective")
"""The estimator's activation checkpointing policies (zerodp.checkpointing.apply)."""


def estimate_rows(numel: int, num_ranks: int, dtype: str, largest_layer: int = 0,
                  module: "torch.nn.Module | None" = None, work: Workload | None = None, micro_batch: int = 1,
                  seq_len: int = 0, policies: tuple[str, ...] = ("none",),
                  progress: Callable[[str], None] | None = None,
                  initialize: EngineFactory | None = None, quantization: str = "none",
                  sequence_parallel: int = 1, zeropp: ZeroPlusPlus = ZeroPlusPlus()) -> list[dict]:
    """One plain-data row per strategy (`zerodp estimate --json`) and activation checkpointing policy:
    model states on the device, in host memory and on NVMe, per rank (rank 0), DeepSpeed's figure
    beside, and with `work` (whose `module` was built on the meta device) the peak of one simulated
    training step at this micro-batch and sequence length (zerodp/plan/simulate.py); else one flat
    group of `numel` and `peak_bytes` None. `progress(line)` hears of each simulation; `initialize` builds
    the simulated engines (default: zerodp.initialize; zerodp/plan/engines.py). `quantization` names how
    `module`'s frozen base is stored ("nf4": zerodp/plan/quantized.py made it), for the rows and for
    DeepSpeed's figure, which has no such case (None). `sequence_parallel` S: Ulysses over S of the
    `num_ranks` ranks (zerodp/plan/sequence.py: the model states are the same, ZeRO partitions over all
    ranks; the rank holds L/S tokens; its all-to-all bytes are in `all_to_all_bytes`). `zeropp`: the ZeRO++
    keys of the stage-3 rows (zerodp/plan/zeropp.py; rows the runtime refuses with them are left out); a
    simulated row's `comm_ops` is its step's comm ledger by op and dtype (int8 payloads apart from fp32 scales)."""
    simulated: dict = {}
    strategies = [s for s in every_strategy(dtype) if zeropp.trains(s)]
    runs = len(policies) * len({s.device_twin() for s in strategies})
    rows = []
    for policy in policies if work is not None else (None,):
        sp_fields = _sequence_fields(module, dtype, micro_batch, seq_len if work is not None else 0, sequence_parallel,
                                     policy)
        for s in strategies:
            if module is None:
                states = model_states(numel, num_ranks, s)
            else:
                flats = module_flats(module, s.stage, num_ranks, offload_param=s.offload_param)
                states = flat_states(flats, num_ranks, s, buffer_bytes=buffer_bytes(module),
                                     hpz_partition_size=zeropp.hpz(s))
            row = {"stage": s.stage, "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
                   "activation_checkpointing": policy, "dtype": dtype, "world_size": num_ranks,
                   "micro_batch": micro_batch if work is not None else None, "seq_len": seq_len if work is not None else None,
                   "model_states_bytes": states.bytes(DEVICE), "peak_bytes": None, "host_bytes": states.bytes(CPU),
                   "nvme_bytes": states.bytes(NVME), "by_category": {f"{c} ({t})": b for (c, t), b in states.held.items()},
                   "quantization": quantization, "trainable_params": numel,
                   "deepspeed_bytes": None if quantization != "none" else deepspeed_estimate(numel, num_ranks, s,
                                                                                               largest_layer),
                   "strategy": s.describe(), "zeropp": zeropp.zero_keys(s), **sp_fields}
            if work is not None:
                row.update(_peak_fields(simulated, work, s, num_ranks, micro_batch, seq_len, policy, runs, progress,
                                        initialize, sequence_parallel, zeropp))
            rows.append(row)
    return rows


def _peak_fields(cache: dict, work: Workload, s: StrategySpec, num_ranks: int, micro_batch: int, seq_len: int,
                 policy: str, runs: int, progress: Callable[[str], None] | None,
                 initialize: EngineFactory | None = None, sequence_parallel: int = 1,
                 zeropp: ZeroPlusPlus = ZeroPlusPlus()) -> dict:
    """A row's simulated fields, simulating the device twin of `s` once (`cache`). A model whose step
    cannot run on fake tensors gets `peak_error` instead (ValueError, a bad input, is raised)."""
    say = progress or (lambda line: None)
    twin = (s.device_twin(), policy)  # the ZeRO++ keys are the same for every row
    if twin not in cache:
        say(f"simulating {len(cache) + 1}/{runs}: {s.describe()}, activation checkpointing {policy}")
        try:
            cache[twin] = simulate_strategy(work, s, num_ranks, micro_batch, seq_len, policy, initialize=initialize,
                                            sequence_parallel=sequence_parallel, zero=zeropp.zero_keys(s),
                                            ranks_per_node=zeropp.ranks_per_node(s))
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
            "activations_bytes": sim.activations, "host_peak_bytes": None if nvme else sim.peak[CPU].bytes,
            "comm_bytes": dict(sim.step_comm.bytes), "comm_ops": sim.step_ops}


def _sequence_fields(module: "torch.nn.Module | None", dtype: str, micro_batch: int, seq_len: int,
                     sequence_parallel: int, policy: str | None) -> dict:
    """A row's sequence-parallel fields: S, and with a model and a sequence length the all-to-all bytes
    one rank hands over per layer and per micro-batch under checkpointing `policy` (zerodp/plan/sequence.py:
    the comm ledger's count)."""
    heads = model_heads(module)
    exchanged = None if heads is None or not seq_len else \
        all_to_all_bytes(heads, micro_batch, seq_len, sequence_parallel, DTYPES[dtype], policy).as_dict()
    return {"sequence_parallel": sequence_parallel, "all_to_all_bytes": exchanged}


def longest_trainable_sequence(work: Workload, strategy: StrategySpec, world_size: int, sp_size: int, budget_bytes: int,
                               activation_checkpointing: str = "blocks", micro_batch: int = 1, granule: int = 1024,
                               start: int | None = None) -> Longest:
    """The longest sequence (a multiple of `granule` tokens) one rank of `world_size` trains `work` in
    within `budget_bytes` of device memory with `strategy` (a StrategySpec), Ulysses over `sp_size`
    ranks and this checkpointing policy: zerodp/plan/sequence.py's `longest_sequence` over simulated peaks,
    starting at `start` tokens (default 8192 x sp_size, where the sequence's bytes already dominate)."""
    def peak(seq_len: int) -> int:
        sim = simulate_strategy(work, strategy, world_size, micro_batch, seq_len, activation_checkpointing,
                                sequence_parallel=sp_size)
        return sim.peak[DEVICE].bytes

    return longest_sequence(peak, budget_bytes, granule, start or 8 * granule * sp_size)
