"""Training steps of zerodp's own engine that hold no memory: fake tensors on a fake process group.

    with simulated_world(world_size=1024) as world:
        model = build()                        # under the fake mode: shapes only
        engine, *_ = zerodp.initialize(model=model, config=config)
        world.start_training()
        ...forward, backward, step, with world.phase = "forward" / "backward" / "step"...
    world.peak                                 # the most live bytes on the device, and when

[Note: simulating a rank]
The estimator's activations and transients are measured, not modelled: the engine that trains runs
its real code for one rank of N under torch's FakeTensorMode (tensors with shapes, dtypes and
devices but no data) on torch's fake process group (collectives that move nothing). Every storage
an op creates is counted by a dispatch mode while it lives, so the peak is what that rank's code
would hold, for any architecture, activation checkpointing policy and world size, on one CPU in
seconds. The rank trains on `meta` (comm.device_for_backend under the fake backend), which stands
for its GPU, so device tensors and host tensors (offload) stay apart as on a GPU; or on `cpu`, as a
CPU-only run does (bench/estimate_accuracy.py checks those against the allocator of real runs).
A tensor handed to an async collective lives until the collective is waited for (comm.Pending
holds it), as it must in a real run. What a fake run does not reproduce:
- data: `.item()` answers 0 (False for a bool), so the step takes the common path (no overflow,
  nothing clipped); zerodp's checks that compare ranks' values are skipped (`comm.simulated()`),
  and `comm.gather_messages` answers every rank's message as this rank's;
- files: NVMe offload is simulated as CPU offload (the device runs the same code either way; the
  host side comes from the ledger);
- the allocator and kernels: fragmentation, the CUDA context and kernels' own scratch memory come
  on top of live tensors (on the CPU the simulation came out 0.0-1.6% below the allocator's peak on
  the small models of tests/test_simulate.py and `bench/estimate_accuracy.py --quick`, within 0.01%
  on the 110M/125M ones);
- attention: on meta, torch would take its math path (an s x s score matrix per head, upcast to
  fp32), which no GPU run takes; `F.scaled_dot_product_attention` on meta runs as a GPU does: flash
  attention in 16 bits without a mask, memory-efficient attention otherwise (both keep O(s) per
  head for backward). With enable_gqa, keys and values are repeated to the query heads first (a
  GPU kernel that shares them natively holds less).
- packed documents: transformers (5.x) looks for them in the position ids by value when no key/value
  cache is passed, and treats a fake tensor as traced, so it would build an s x s mask that the real
  batch does not get. The estimator's rows are one sequence each (positions 0..s-1, or a contiguous
  shard of them under Ulysses), so on fake tensors the check answers "not packed", as it does for
  the real batch (`unpacked_rows`; the FLOP count on meta uses it too).
Storage resizes (stage 3 frees a gathered unit with `UntypedStorage.resize_(0)`) do not pass
through dispatch, so `UntypedStorage.resize_` is wrapped while the world exists.
torch's private `torch.testing._internal.distributed.fake_pg` and the fused-optimizer device list
are pinned by tests/test_simulate.py; without the first `simulated_world` raises SimulationUnavailable.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerodp import checkpointing, comm
from zerodp.memory import CPU, DEVICE
from zerodp.plan.engines import EngineFactory, build_engine
from zerodp.plan.model_states import StrategySpec, strategy_config

if TYPE_CHECKING:
    from zerodp.plan.workload import Workload

TOTAL = "total"  # LiveBytes.peak's key for the device and host memory together



class SimulationUnavailable(RuntimeError):
    """This torch lacks what a simulation needs (its fake process group or FakeTensorMode)."""


@dataclass
class Peak:
    """The most bytes live at once in one tier, and the phase ("forward", "backward", "step") it
    happened in."""

    bytes: int = 0
    phase: str = ""


@dataclass
class LiveBytes(TorchDispatchMode):
    """Bytes of every live storage created under it (or given to `track`), by tier (device: on
    `device_type`, cpu: the rest, host memory), with each tier's peak and the peak of their sum
    ("total"); on fake tensors `.item()` answers 0 (see [Note: simulating a rank])."""

    device_type: str = "meta"
    answer_scalars: bool = True  # fake tensors have no values; a real run's count (the doctor's) reads them
    live: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, CPU: 0})
    peak: dict[str, Peak] = field(default_factory=lambda: {DEVICE: Peak(), CPU: Peak(), TOTAL: Peak()})
    phase: str = "initialize"
    sizes: dict[int, tuple[str, int]] = field(default_factory=dict)  # id(storage) -> (tier, bytes)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.answer_scalars and func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        self._register(t.untyped_storage(), t.device.type, 0)

    def _register(self, storage: torch.UntypedStorage, device_type: str, counted: int) -> None:
        key = id(storage)
        if key not in self.sizes:
            self.sizes[key] = (DEVICE if device_type == self.device_type else CPU, counted)
            weakref.finalize(storage, self._freed, key)
        self.resized(storage)

    def resized(self, storage: torch.UntypedStorage, before: int | None = None) -> None:
        """Count a tracked storage's current size (after an op or a resize_; a storage first seen
        in a resize_ from `before` bytes is tracked from then on)."""
        known = self.sizes.get(id(storage))
        if known is None:
            if before is not None:
                self._register(storage, storage.device.type, before)
            return
        tier, before = known
        now = storage.nbytes()
        if now != before:
            self.sizes[id(storage)] = (tier, now)
            self.live[tier] += now - before
            if self.live[tier] > self.peak[tier].bytes:
                self.peak[tier] = Peak(self.live[tier], self.phase)
            total = sum(self.live.values())
            if total > self.peak[TOTAL].bytes:
                self.peak[TOTAL] = Peak(total, self.phase)

    def _freed(self, key: int) -> None:
        tier, size = self.sizes.pop(key)
        self.live[tier] -= size

    def start_training(self) -> None:
        """Peaks from now on (initialize's own, with the whole model built before partitioning, are
        left out: zero.Init avoids them in a real run)."""
        self.peak = {tier: Peak(b, self.phase) for tier, b in self.live.items()}
        self.peak[TOTAL] = Peak(sum(self.live.values()), self.phase)


@contextmanager
def simulated_world(world_size: int, rank: int = 0, device: str = "meta") -> Iterator[LiveBytes]:
    """A fake process group of `world_size` ranks in which this process is `rank`, training on
    `device` ("meta": a GPU; "cpu": a CPU-only run, where device and host memory are one), under
    FakeTensorMode, counting live bytes; everything is torn down on exit."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise SimulationUnavailable(f"this torch ({torch.__version__}) has no fake process group: {err}") from None
    if dist.is_initialized():
        raise SimulationUnavailable("a process group already exists in this process; simulate in a fresh one")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: " to every traceback line
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    comm.set_simulated_device(torch.device(device))
    recorder = LiveBytes(device)
    try:
        with _fused_kernels_on(device), FakeTensorMode(allow_non_fake_inputs=True), counting_resizes(recorder), \
                recorder, _gpu_attention(), unpacked_rows():
            yield recorder
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@contextmanager
def counting_resizes(recorder: LiveBytes) -> Iterator[None]:
    """`UntypedStorage.resize_` (which does not pass through dispatch) tells `recorder` while inside."""
    resize = torch.UntypedStorage.resize_

    def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
        before = storage.nbytes()
        out = resize(storage, size)
        recorder.resized(storage, before)
        return out

    torch.UntypedStorage.resize_ = tracked_resize
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize


@contextmanager
def _gpu_attention() -> Iterator[None]:
    """`F.scaled_dot_product_attention` on meta tensors as a GPU runs it (see [Note: simulating a
    rank]). The function itself is replaced while the world exists: torch's function modes do not
    reach the recomputation of checkpointed blocks, which autograd runs on its own thread for meta."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:
        if query.device.type != "meta":
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], dim=-3) for t in (key, value))
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                     scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                                     is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextmanager
def unpacked_rows() -> Iterator[None]:
    """transformers' packed-document check answers "not packed" for position ids without values (fake
    or meta) while inside (see [Note: simulating a rank]); a no-op where transformers is not imported or
    has no such check."""
    from torch._subclasses.fake_tensor import FakeTensor

    masking = None
    if "transformers" in sys.modules:  # a model of transformers' is built after the world starts
        try:
            import transformers.masking_utils as masking
        except ImportError:  # a transformers before 4.53 checks nothing
            pass
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        valueless = isinstance(position_ids, FakeTensor) or position_ids.device.type == "meta"
        return None if valueless else original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextmanager
def _fused_kernels_on(device_type: str) -> Iterator[None]:
    """torch's fused optimizers accept `device_type` tensors (the simulated device stands for a GPU,
    where zerodp steps with fused Adam: in place, no temporaries)."""
    from torch.optim import optimizer as optimizer_module

    supported = optimizer_module._get_fused_kernels_supported_devices
    optimizer_module._get_fused_kernels_supported_devices = lambda: [*supported(), device_type]
    try:
        yield
    finally:
        optimizer_module._get_fused_kernels_supported_devices = supported


@dataclass(frozen=True)
class CommVolume:
    """Collectives one rank ran, per op ("all_gather", "reduce_scatter", ...): bytes as the comm
    ledger counts them (zerodp/comm/ledger.py: all-reduce twice its tensor) and calls."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def of(records: dict) -> "CommVolume":
        """The volume of a comm ledger phase (records keyed by (op, dtype))."""
        out = CommVolume()
        for (op, _), rec in records.items():
            out.bytes[op] = out.bytes.get(op, 0) + rec.bytes
            out.calls[op] = out.calls.get(op, 0) + rec.calls
        return out

    def minus(self, other: "CommVolume") -> "CommVolume":
        return CommVolume({op: b - other.bytes.get(op, 0) for op, b in self.bytes.items()},
                          {op: c - other.calls.get(op, 0) for op, c in self.calls.items()})


@dataclass
class Simulation:
    """What one simulated rank held while training: peaks by tier (device, cpu), the engine's
    memory report (the ledger), the device bytes one micro-batch's forward left for backward, and
    the collectives of the last optimizer step (`step_comm`) and of one of its micro-batches before
    the last (`micro_comm`; None without gradient accumulation); `step_ops`: the last step's collectives as
    the comm ledger reports them (`comm_report(...)["ops"]`: per op and dtype, calls, elements, bytes, bytes by
    link), which tells a quantized collective's int8 payload from its fp32 scales (ZeRO++)."""

    peak: dict[str, Peak]
    memory: dict
    activations: int
    step_comm: CommVolume = field(default_factory=CommVolume)
    micro_comm: CommVolume | None = None
    step_ops: dict = field(default_factory=dict)


def simulate_training(build: Any, config: dict, batch: Any, world_size: int, rank: int = 0, device: str = "meta",
                      steps: int = 2, prepare: Any = None, initialize: EngineFactory | None = None,
                      ranks_per_node: int | None = None) -> Simulation:
    """Run `steps` optimizer steps of `build()` (an nn.Module factory) under `config` as `rank` of
    `world_size`, simulated on `device` (see simulated_world). `batch(model, device)` -> (args, kwargs)
    of one micro-batch; the model's output is the loss, or has `.loss`. `prepare(model)` runs before initialize (activation checkpointing).
    Step 2 is the steady state: step 1 also creates the optimizer state. `initialize` builds the engine
    (default: zerodp.initialize; see zerodp/plan/engines.py). `ranks_per_node`: the ledger counts bytes by link
    as if consecutive blocks of that many ranks shared a node (default: every rank on one node, as the fake
    group's gathered host names say; hpZ's secondary groups are meant to be nodes)."""
    import logging
    import warnings

    before_disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # initialize's lines are about a run that does not happen
    try:
        with simulated_world(world_size, rank, device) as world, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # alias checks
            with torch.device(device):
                model = build()
            if prepare is not None:
                prepare(model)
            engine = build_engine(initialize, model=model, config=config)
            del model
            if ranks_per_node is not None:  # after initialize, which told the ledger the fake group's layout
                comm.set_node_layout([r // ranks_per_node for r in range(world_size)])
            world.start_training()
            live_at: dict[str, int] = {}
            sent_before: list[CommVolume] = []  # the step's collectives so far, as each forward starts

            def enter(phase: str) -> None:
                world.phase, live_at[phase] = phase, world.live[DEVICE]
                if phase == "forward":
                    sent_before.append(CommVolume.of(comm.ledger.current))

            train_steps(engine, batch, steps, enter)
            activations = live_at["backward"] - live_at["forward"]  # what the last forward left for backward
            accumulation = engine.gradient_accumulation_steps()
            micro = sent_before[-1].minus(sent_before[-2]) if accumulation > 1 else None
            return Simulation(dict(world.peak), engine.memory_report(), activations,
                              CommVolume.of(comm.ledger.last_step), micro,
                              comm.comm_report(comm.ledger.last_step)["ops"])
    finally:
        logging.disable(before_disabled)


def train_steps(engine: Any, batch: Any, steps: int, enter: Any = None) -> None:
    """`steps` optimizer steps of `engine`, each micro-batch from `batch(model, device)` (its output
    the loss or with `.loss`); `enter(phase)` hears "forward", "backward", "step" as each starts
    (the simulation and zerodp/plan/measure.py's real run share this loop)."""
    enter = enter or (lambda phase: None)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        args, kwargs = batch(engine.module, engine.device)
        enter("forward")
        out = engine(*args, **kwargs)
        enter("backward")
        engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
        del out
        if engine.is_gradient_accumulation_boundary():
            enter("step")
        engine.step()  # after every micro-batch, as DeepSpeed's loop; it steps at the boundary


def simulate_strategy(work: "Workload", strategy: StrategySpec, world_size: int, micro_batch: int, seq_len: int,
                      activation_checkpointing: str = "none", device: str = "meta", rank: int = 0,
                      accumulation: int = 1, zero: dict | None = None,
                      initialize: EngineFactory | None = None, sequence_parallel: int = 1,
                      ranks_per_node: int | None = None) -> Simulation:
    """Simulate `strategy` training `work` (zerodp/plan/workload.py) at this micro-batch and sequence
    length, with activation checkpointing "none", "blocks" (every repeated block) or "selective"
    (blocks, keeping matmul and attention outputs), `accumulation` micro-batches per step (default 1)
    and `zero`'s zero_optimization keys on top (bucket sizes). NVMe offload runs as CPU offload: the
    device runs the same code either way; what differs is in host memory and files, which the ledger gives.
    `sequence_parallel` S > 1: Ulysses over S of the `world_size` ranks, the rank holding its S-th of
    the sequence (zerodp/plan/sequence.py; a Hugging Face model whose heads S splits). `ranks_per_node`: as
    simulate_training's (zerodp/plan/zeropp.py gives hpZ's)."""
    from zerodp.plan.sequence import sharded_inputs, simulated_ulysses

    if work.inputs is None:
        raise ValueError(f"MODEL {work.spec!r}: its input is unknown (not a causal LM), so its activations cannot be "
                         "estimated")
    config = strategy_config(strategy.device_twin(), micro_batch, accumulation)
    config["zero_optimization"].update(zero or {})
    batch = lambda m, dev: work.inputs(m, micro_batch, seq_len, dev)  # noqa: E731
    if sequence_parallel > 1:
        config["sequence_parallel_size"] = sequence_parallel
        batch = sharded_inputs(work, micro_batch, seq_len, sequence_parallel)
    with simulated_ulysses(sequence_parallel) as ulysses:
        def prepare(model: torch.nn.Module) -> None:
            if activation_checkpointing != "none":
                checkpointing.apply(model, "blocks", selective=activation_checkpointing == "selective")
            if sequence_parallel > 1:
                ulysses(model)

        return simulate_training(work.build, config, batch, world_size, rank, device, prepare=prepare,
                                 initialize=initialize, ranks_per_node=ranks_per_node)
