"""A cluster as the planner sees it, and the step-time model: pure arithmetic, numbers in, numbers out.

[Note: the step-time model]
One optimizer step of one rank, for a candidate that accumulates `a` micro-batches of `m` samples:
- compute: a x (micro_batch_overhead + FLOPs of one micro-batch's forward and backward / (peak_flops x
  efficiency)); the FLOPs are counted (torch's FlopCounterMode on the model as it trains, activation
  checkpointing's recomputation included), the efficiency is assumed (GPU presets) or measured;
- communication: every collective the simulated step ran (zerodp/plan/simulate.py, the comm ledger's
  bytes and calls), each taking bytes x (N-1)/N / bandwidth + latency (a ring; the inter-node
  bandwidth when the job spans nodes, since every ZeRO group then spans them), of which `overlap`
  x min(communication, compute) hides behind compute (buckets reduced from backward hooks, stage 3's
  prefetch; 0 on CPU, where gloo and the kernels share the cores), except Ulysses' all-to-alls,
  priced apart ([Note: pricing Ulysses' all-to-all]) and never hidden;
- the optimizer step: Adam over the elements this rank owns, on the device (device_adam_rate) or on
  the host's cores (host_adam_rate shared by the node's ranks), plus, offloaded, the gradients down and
  the updated parameters up over the host-device link, and with NVMe the state read and written;
- parameter offload (stage 3): every micro-batch fetches the parameter shard from the host twice
  (forward and backward), and from the disk first when it lives on NVMe.
The parts add up: nothing but communication is assumed to overlap.

[Note: pricing Ulysses' all-to-all]
With sequence parallelism S (zerodp/plan/sequence.py), the comm ledger's `all_to_all` bytes are the
tensors each rank hands to Ulysses' exchanges. Unlike ZeRO's collectives these run inside one
sequence-parallel group: S consecutive ranks (zero/topology.py's [Note: sequence-parallel groups]), so
one node when S divides the GPUs per node. In an all-to-all a rank sends each of its S-1 peers one
S-th of the tensor, once (no ring's relay: (S-1)/S of it leaves the rank, not 2(N-1)/N or (N-1)/N
of it over all N ranks): the chunks for peers on its own node go over `intra_node_bandwidth`, those
for peers on other nodes over `inter_node_bandwidth`, both at once, so its time is the slower of the
two. The step waits for the slowest rank of the slowest group (`sequence_group_peers`). None of it
hides behind compute: the attention that follows needs what it brings, and the exchange is not
asynchronous (zerodp/sequence/all_to_all.py). `all_to_all_seconds` is the one place this is priced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerodp.gpus import GPUS

ULYSSES_OP = "all_to_all"  # the comm ledger's op for Ulysses' exchanges (zerodp/sequence/all_to_all.py)
ADAM_BYTES_PER_ELEMENT = 28  # fused Adam reads fp32 param, grad, two moments and writes three of them
NVME_STATE_BYTES = 16  # fp32 master + two moments (+ the gradient), read and written per step


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for. Rates are per rank (one GPU) unless named per node."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_bytes: int = 80 * 10**9
    host_memory_bytes: int = 10**12  # per node
    nvme_bytes: int = 0  # per node; 0: no NVMe offload
    peak_flops: float = 989e12  # dense, in the training dtype
    efficiency: float = 0.45  # of peak_flops, reached by a large micro-batch
    micro_batch_overhead: float = 0.005  # seconds per micro-batch beyond its FLOPs (launches, hooks)
    intra_node_bandwidth: float = 300e9  # bytes/s a ring collective moves per rank inside a node
    inter_node_bandwidth: float = 25e9  # bytes/s per rank across nodes
    collective_latency: float = 30e-6  # seconds per collective call
    overlap: float = 0.8  # the fraction of min(communication, compute) that runs hidden
    host_device_bandwidth: float = 25e9  # bytes/s per rank, each way
    disk_bandwidth: float = 3e9  # bytes/s per node
    device_adam_rate: float = 3.35e12 / ADAM_BYTES_PER_ELEMENT  # elements/s on the device
    host_adam_rate: float = 2e9  # elements/s per node on its CPU cores
    headroom: float = 0.1  # the fraction of gpu_memory_bytes kept free (allocator fragmentation, CUDA context)
    device: str = "cuda"  # "cpu": the ranks train on the host (device memory is host memory: no offload)
    name: str = "h100"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_bytes(self) -> int:
        """Device bytes a candidate's peak may reach."""
        return int(self.gpu_memory_bytes * (1 - self.headroom))


CPU_RANKS = dict(peak_flops=50e9, efficiency=1.0, micro_batch_overhead=0.01, intra_node_bandwidth=2e9,
                 inter_node_bandwidth=0.1e9, collective_latency=1e-4, overlap=0.0, device_adam_rate=1e8,
                 headroom=0.0, device="cpu", name="cpu")
"""Ranks training on CPU cores (gloo): orders of magnitude for one core per rank; measure this
machine's with bench/plan_accuracy.py's probes and pass them as flags."""


def gpu_cluster(gpu: str = "h100", **overrides: object) -> Cluster:
    """The Cluster of a GPU preset (see GPUS; "cpu": ranks on CPU cores, CPU_RANKS), with any field
    overridden (ValueError naming `gpu`)."""
    if gpu == "cpu":
        return replace(Cluster(**CPU_RANKS), **overrides)
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: expected one of {', '.join([*GPUS, 'cpu'])}")
    memory, flops, memory_bandwidth, nvlink, host_link = GPUS[gpu]
    base = Cluster(gpu_memory_bytes=memory, peak_flops=flops, device_adam_rate=memory_bandwidth / ADAM_BYTES_PER_ELEMENT,
                   intra_node_bandwidth=nvlink, host_device_bandwidth=host_link, name=gpu)
    return replace(base, **overrides)


@dataclass(frozen=True)
class Work:
    """What one candidate's optimizer step does on one rank (from its simulation, its FLOP count and
    the estimator's arithmetic)."""

    flops_per_micro: float
    accumulation: int
    comm_bytes: dict[str, float]  # per op, the whole step
    comm_calls: dict[str, float]
    optimizer_numel: int  # elements this rank's optimizer steps
    grad_bytes: int  # the rank's gradient shard in the working dtype (offload: copied down per step)
    param_shard_bytes: int  # the rank's parameter shard (parameter offload: fetched twice per micro-batch)
    offload_optimizer: str = "none"
    offload_param: str = "none"
    sequence_parallel: int = 1  # ranks per sequence: > 1, comm's ULYSSES_OP runs in their group


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part."""

    compute: float
    communication: float
    exposed_communication: float
    optimizer: float
    offload: float
    all_to_all: float = 0.0  # Ulysses' all-to-alls, within communication and exposed_communication (all exposed)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_communication + self.optimizer + self.offload

    def as_dict(self) -> dict:
        return {**vars(self), "total": self.total}


def step_time(work: Work, cluster: Cluster) -> StepTime:
    """The predicted step time of `work` on `cluster` (see [Note: the step-time model])."""
    c, w = cluster, work
    compute = w.accumulation * (c.micro_batch_overhead + w.flops_per_micro / (c.peak_flops * c.efficiency))
    ring = (c.world_size - 1) / c.world_size
    bandwidth = c.inter_node_bandwidth if c.nodes > 1 else c.intra_node_bandwidth
    apart = (ULYSSES_OP,) if w.sequence_parallel > 1 else ()  # priced in its group, not as a ring over all ranks
    rings = sum(b * ring / bandwidth for op, b in w.comm_bytes.items() if op not in apart) + \
        c.collective_latency * sum(n for op, n in w.comm_calls.items() if op not in apart)
    exchanges = all_to_all_seconds(w.comm_bytes.get(ULYSSES_OP, 0), w.comm_calls.get(ULYSSES_OP, 0),
                                   w.sequence_parallel, c) if apart else 0.0
    if c.world_size == 1:
        rings = 0.0
    communication = rings + exchanges
    exposed = rings - c.overlap * min(rings, compute) + exchanges
    per_node = c.gpus_per_node
    offload = 0.0
    if w.offload_optimizer == "none":
        optimizer = w.optimizer_numel / c.device_adam_rate
    else:
        optimizer = w.optimizer_numel / (c.host_adam_rate / per_node)
        offload += 2 * w.grad_bytes / c.host_device_bandwidth  # gradients down, updated parameters up
        if w.offload_optimizer == "nvme":
            offload += 2 * NVME_STATE_BYTES * w.optimizer_numel / (c.disk_bandwidth / per_node)
    if w.offload_param != "none":
        fetched = 2 * w.accumulation * w.param_shard_bytes
        offload += fetched / c.host_device_bandwidth
        if w.offload_param == "nvme":
            offload += fetched / (c.disk_bandwidth / per_node)
    return StepTime(compute, communication, exposed, optimizer, offload, exchanges)


def sequence_group_peers(sp_size: int, gpus_per_node: int, num_ranks: int) -> set[tuple[int, int]]:
    """(peers on the rank's node, peers on other nodes) of each rank in its sequence-parallel group of
    `sp_size` consecutive ranks (ranks 0..S-1, S..2S-1, ...; node n holds ranks n x gpus_per_node ..),
    the distinct pairs over all `num_ranks` ranks."""
    pairs = set()
    for first in range(0, num_ranks, sp_size):
        nodes = [r // gpus_per_node for r in range(first, first + sp_size)]
        pairs.update((nodes.count(node) - 1, sp_size - nodes.count(node)) for node in set(nodes))
    return pairs


def all_to_all_seconds(handed_bytes: float, calls: float, sp_size: int, cluster: Cluster) -> float:
    """Seconds of Ulysses' all-to-alls that hand `handed_bytes` over in `calls` calls on each rank
    (what the comm ledger counts) inside sequence-parallel groups of `sp_size` ranks on `cluster`: of
    each call a rank sends 1/S to each peer, its own node's at intra_node_bandwidth and the others'
    at inter_node_bandwidth at once, plus collective_latency per call; the slowest rank's time (see
    [Note: pricing Ulysses' all-to-all]). 0 for S = 1."""
    c = cluster
    if sp_size == 1:
        return 0.0
    if c.world_size % sp_size:
        raise AssertionError(f"sequence parallel {sp_size} does not divide the {c.world_size} ranks")
    chunk = handed_bytes / sp_size
    slowest = max(max(on_node * chunk / c.intra_node_bandwidth, off_node * chunk / c.inter_node_bandwidth)
                  for on_node, off_node in sequence_group_peers(sp_size, c.gpus_per_node, c.world_size))
    return slowest + c.collective_latency * calls
