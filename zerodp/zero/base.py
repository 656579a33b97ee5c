"""The Strategy contract: one class per ZeRO stage behind one small interface.

The engine owns the training loop (accumulation, loss scale, schedule, counters); a strategy owns
where parameters, gradients and optimizer state live and the collectives that move them. The
engine never branches on the stage number.

[Note: step protocol]
Per micro-batch the engine calls `before_backward(boundary)`, runs autograd, then
`after_backward(boundary)`. Off the boundary a strategy only accumulates (no communication),
unless it `reduces_every_micro_batch` (stage 2). At the boundary step the engine calls
`finish_reduction()` (which reduces now if the boundary backward did not: `no_sync`, a forced
boundary, `managed_gradient_accumulation: false`), `found_overflow()` (answer identical on every
rank), then either `step(loss_scale, max_norm)` or nothing, then `zero_grad()`.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator

import torch
from torch import nn

from zerodp import comm
from zerodp.accumulation import AccumulationClock
from zerodp.memory import MemoryLedger
from zerodp.offload.cpu import Home
from zerodp.precision import DtypePolicy
from zerodp.zero.topology import gradient_mean_factor

if TYPE_CHECKING:
    from zerodp.offload.swap import OptimizerSwapper

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
"""Builds the optimizer over the param groups a strategy hands it (its own tensors, the
user's hyperparameters)."""


class BackwardPass(enum.Enum):
    """Which backward pass, if any, this strategy is inside ([Note: backward pass states])."""

    IDLE = "idle"  # no pass open: before_backward has not run since the last after_backward
    EXPLICIT = "explicit"  # engine.backward opened it and closes it
    IMPLICIT = "implicit"  # a gradient hook of a plain loss.backward() opened it; autograd's final callback closes it
    CLOSING = "closing"  # after_backward running: hooks it triggers open no pass


@dataclass
class Piece:
    """Elements [offset, offset + numel) of trainable parameter `name` (param group `group`) as
    this rank holds them: `tensors` maps "master" (the optimizer's weights: fp32, or bf16 with
    bf16_master_weights_and_grads) and each element-wise optimizer
    state key (e.g. "exp_avg") to a flat view of live storage, so a checkpoint reads from and
    writes into it directly."""

    name: str
    group: int
    offset: int
    numel: int
    tensors: dict[str, torch.Tensor]


@dataclass
class Fragment:
    """This rank's part of one trainable parameter, for the tensor-fragment API (zero/fragments.py):
    elements [offset, offset + numel) of the flattened parameter (numel 0: it holds none). `tensors`
    maps "master" and each element-wise optimizer state key to a flat view of live storage; `grad`
    is the same elements of the reduced gradient, None until the boundary backward has reduced it."""

    offset: int
    numel: int
    tensors: dict[str, torch.Tensor]
    grad: torch.Tensor | None


_live_strategies: weakref.WeakValueDictionary[int, Strategy] = weakref.WeakValueDictionary()
"""Every strategy alive in the process by creation number (two engines in one process, RLHF's, each
have one), so the tensor-fragment API, which is given only a parameter, finds the strategy that
trains it: the newest, when a model was wrapped again and the old engine is not collected yet."""
_strategy_numbers = itertools.count()


def strategy_training(param: torch.Tensor) -> Strategy | None:
    """The newest live strategy whose optimizer updates `param`, or None (frozen, forward only, not zerodp's)."""
    live = sorted(_live_strategies.items(), reverse=True)
    return next((s for _, s in live if s.trains(param)), None)


def index_of(tensors: list[torch.Tensor], tensor: torch.Tensor) -> int:
    """Position of `tensor` itself in `tensors` (list.index would compare values)."""
    return next(i for i, t in enumerate(tensors) if t is tensor)


class Strategy(abc.ABC):
    """Where params, grads and optimizer state live for one ZeRO stage, and how they move."""

    optimizer: torch.optim.Optimizer
    reduces_every_micro_batch = False
    """True when gradients are reduced in every backward (stage 2): `no_sync` cannot apply."""
    swapper: OptimizerSwapper | None = None
    """NVMe offload of the optimizer: the swapper moving its chunks (its `layout()` feeds the offload
    diagnosis); None without."""

    def __init__(self, config, policy: DtypePolicy, device: torch.device,
                 comm_ledger: comm.CommLedger | None = None) -> None:
        self.config = config
        self.policy = policy
        self.device = device
        # its engine's collectives, counted by its hooks too ([Note: one comm ledger per engine], zerodp/comm/ledger.py)
        self.comm_ledger = comm.CommLedger() if comm_ledger is None else comm_ledger
        self.transient_peak: dict[str, int] = {}  # short-lived buffers, by name: largest size seen
        zero = config.zero_optimization
        self.home = Home.for_section(device, zero.offload_optimizer)  # masters, optimizer state, grad shards
        self.param_home = Home.for_section(device, zero.offload_param)  # stage-3 parameter shards
        self.backward_pass = BackwardPass.IDLE  # [Note: backward pass states]
        self.accumulation = AccumulationClock()  # the engine's, once it hands it over (follow)
        _live_strategies[next(_strategy_numbers)] = self
        # each rank's gradient x this, then summed over every rank: the mean over data-parallel replicas,
        # the sum over sequence-parallel ranks ([Note: sequence-parallel groups], zerodp/zero/topology.py)
        self.grad_mean_factor = gradient_mean_factor(comm.get_world_size(), int(config.sequence_parallel_size))

    # [Note: backward passes the engine did not start]
    # A backward can reach this strategy's hooks without engine.backward(): the user's own
    # `loss.backward()` followed by `engine.step()` (DeepSpeed supports it), or another engine's loss
    # running through this model (a GAN's generator loss through the discriminator). The first hook
    # of such a pass opens it as engine.backward would (before_backward with the boundary the
    # engine's AccumulationClock gives) and queues after_backward to run when autograd finishes the
    # pass, so buckets restart and gradients accumulate instead of tripping over the last pass's
    # state. Ranks run the same passes, so any collective the pass launches is paired. (The engine's
    # forward divides such a pass by the accumulation steps; an fp16 engine refuses to step on it
    # without engine.scale(loss).) Not covered: a direct loss.backward() whose first hook fires inside
    # a reentrant checkpoint's inner backward would close the pass when that inner backward ends.
    #
    # [Note: backward pass states]
    #     IDLE --begin_backward (engine.backward)--> EXPLICIT --abort_backward (autograd raised)--> IDLE
    #     IDLE --entering_backward_hook (a hook)---> IMPLICIT
    #     EXPLICIT | IMPLICIT --end_backward (engine.backward / autograd's final callback)--> CLOSING
    #     CLOSING --after_backward returned or raised--> IDLE
    #     IMPLICIT --begin_backward--> EXPLICIT: a plain loss.backward() that raised never ran its queued
    #         callback (autograd drops a failed pass's callbacks), so the engine's next pass replaces it.
    # A hook while a pass is open or closing changes nothing; before_backward raising leaves IDLE (no
    # pass opened). Any other move raises AssertionError naming the rank and both states.

    def follow(self, clock: AccumulationClock) -> None:
        """Take the engine's accumulation clock: passes the engine did not start ask it for their
        boundary and are counted on it."""
        self.accumulation = clock

    def begin_backward(self, boundary: bool) -> None:
        """Open a backward pass for engine.backward (IDLE or an abandoned IMPLICIT -> EXPLICIT)."""
        self._open_pass((BackwardPass.IDLE, BackwardPass.IMPLICIT), BackwardPass.EXPLICIT, boundary)

    @comm.records_to_own_ledger  # also run as autograd's callback at the end of a pass the engine did not start
    def end_backward(self, boundary: bool) -> None:
        """Close the open backward pass (EXPLICIT or IMPLICIT -> CLOSING -> IDLE), running after_backward."""
        self._move_pass((BackwardPass.EXPLICIT, BackwardPass.IMPLICIT), BackwardPass.CLOSING)
        try:
            self.after_backward(boundary)
        finally:
            self.backward_pass = BackwardPass.IDLE

    def abort_backward(self) -> None:
        """Autograd raised inside engine.backward: close the pass without after_backward (EXPLICIT -> IDLE)."""
        self._move_pass((BackwardPass.EXPLICIT,), BackwardPass.IDLE)

    def entering_backward_hook(self) -> None:
        """First call of every gradient hook: open a pass the engine did not start (see the Note)."""
        if self.backward_pass is not BackwardPass.IDLE:
            return
        boundary = self.accumulation.backward_boundary()
        self._open_pass((BackwardPass.IDLE,), BackwardPass.IMPLICIT, boundary)
        self.accumulation.count_implicit_backward()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.end_backward(boundary))

    def _open_pass(self, legal_from: tuple[BackwardPass, ...], kind: BackwardPass, boundary: bool) -> None:
        """Move to `kind` and run before_backward; back to IDLE when before_backward raises (no pass opened)."""
        self._move_pass(legal_from, kind)
        try:
            self.before_backward(boundary)
        except BaseException:
            self.backward_pass = BackwardPass.IDLE
            raise

    def _move_pass(self, legal_from: tuple[BackwardPass, ...], new: BackwardPass) -> None:
        if self.backward_pass not in legal_from:
            raise AssertionError(f"rank {comm.get_rank()}: backward pass {self.backward_pass.name} -> {new.name}, "
                                 f"legal only from {' or '.join(s.name for s in legal_from)}")
        self.backward_pass = new

    def note_transient(self, name: str, tensor: torch.Tensor | int) -> None:
        """Record a short-lived buffer's size (a tensor, or bytes) for the ledger's transient peaks."""
        size = tensor if isinstance(tensor, int) else tensor.numel() * tensor.element_size()
        self.transient_peak[name] = max(self.transient_peak.get(name, 0), size)

    @abc.abstractmethod
    def wrap(self, module: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> None:
        """Place and cast `module`, sync it from rank 0, lay out gradients, install hooks, and
        build `self.optimizer` with `make_optimizer` over this strategy's tensors.

        `param_groups` are the user's groups (trainable parameters only, hyperparameters kept).
        """

    @abc.abstractmethod
    def before_backward(self, boundary: bool) -> None:
        """Called before autograd runs for a micro-batch; `boundary` is the last micro-batch."""

    @abc.abstractmethod
    def after_backward(self, boundary: bool) -> None:
        """Called after autograd; at the boundary, leave this rank's reduced gradients in place."""

    @abc.abstractmethod
    def finish_reduction(self) -> None:
        """At the boundary step: reduce this step's gradients if no backward has done it yet."""

    @abc.abstractmethod
    def found_overflow(self) -> bool:
        """True when any rank's reduced gradients hold inf/nan (same answer on every rank)."""

    @abc.abstractmethod
    def first_overflow_name(self) -> str | None:
        """Name of the first parameter whose reduced gradient is non-finite on this rank."""

    @abc.abstractmethod
    def step(self, loss_scale: float, max_norm: float) -> float:
        """Unscale, clip to `max_norm` (0 = off) by the global norm, run the optimizer, republish
        the parameters. Returns the global gradient norm before clipping."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Reset gradient accumulation for the next optimizer step."""

    @abc.abstractmethod
    def pieces(self, saving: bool) -> list[Piece]:
        """The parameter pieces this rank saves (`saving`), or must fill when loading; each
        element of each trainable parameter is saved by exactly one rank."""

    @abc.abstractmethod
    def piece_index(self, rank: int) -> list[tuple[str, int, int]]:
        """(name, offset, numel) of what `rank` saves: the same on every rank (for meta.json)."""

    @abc.abstractmethod
    def after_load(self) -> None:
        """Make the working parameters equal the loaded masters on every rank (may communicate)."""

    def layout_state(self) -> dict | None:
        """Plain data a checkpoint keeps so a resumed run communicates in the same layout (stage
        0's bucket order); None when the layout is fixed by the config."""
        return None

    def load_layout_state(self, state: dict | None) -> None:
        """Restore what `layout_state` returned (between steps, gradients zero)."""

    def error_hint(self, error: BaseException) -> str | None:
        """A line added to `error`, raised in the model's forward or backward, when it is likely what
        this stage changes that caused it; None otherwise."""
        return None

    def close(self) -> None:
        """Release files and threads (NVMe offload); the strategy is unusable afterwards."""
        for store in self.swap_stores().values():
            store.close()
            store.engine.close()

    def resident_pieces(self, saving: bool) -> Iterator[tuple[list[torch.Tensor], Callable[[], list[Piece]]]]:
        """`pieces(saving)` in batches that are in memory together: (the optimizer tensors the
        batch's pieces are views of, a function making the pieces). A load creates the tensors'
        optimizer state before it makes the pieces. One batch here; NVMe offload yields one swap
        chunk at a time, so a checkpoint never holds the rank's whole optimizer shard. A batch is
        valid until the next is asked for; a load's changes are written back."""
        yield [t for group in self.optimizer.param_groups for t in group["params"]], lambda: self.pieces(saving)

    def swap_stores(self) -> dict:
        """NVMe offload's swap stores by what they hold ("optimizer", "parameters"); {} without."""
        return {}

    def num_piece_batches(self) -> int:
        """How many batches `resident_pieces` yields (the same on every rank)."""
        return 1

    def parameter_storages(self) -> list[torch.Tensor]:
        """Tensors whose storages hold the parameters (left out of the saved-activation count)."""
        return list(self.module.parameters())

    def generation(self, max_live_numel: int) -> ContextManager[None]:
        """engine.generation(): keep units gathered across the block's forwards, at most
        `max_live_numel` elements (stage 3). Parameters are whole at stages 0-2: nothing to keep."""
        return contextlib.nullcontext()

    def check_full_weights_allowed(self) -> None:
        """Raise when the config forbids gathering full weights for save_16bit_model (stage 3)."""

    def gathered_state_dict(self, keep: Callable[[str], bool] | None = None) -> dict:
        """The module's state dict with full tensors (entries whose name passes `keep`), on rank 0
        at least: stage 3 gathers one unit at a time and returns {} on other ranks. Every rank calls."""
        return {n: t for n, t in self.module.state_dict().items() if keep is None or keep(n)}

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy full values (buffers, frozen parameters, by state-dict name) into the module; every
        rank passes the same values, no communication."""
        current = {**dict(self.module.named_buffers(remove_duplicate=False)),
                   **dict(self.module.named_parameters(remove_duplicate=False))}
        for name, tensor in state.items():
            if name in current:
                current[name].copy_(tensor)

    # --- the tensor-fragment API (zero/fragments.py) ------------------------------------------------

    def trains(self, param: torch.Tensor) -> bool:
        """Whether this strategy's optimizer updates `param` (set up by wrap)."""
        return False

    def fragment(self, param: torch.Tensor) -> Fragment:
        """This rank's part of trainable `param` (views of live storage)."""
        raise NotImplementedError(f"{type(self).__name__} does not provide the tensor-fragment API")

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's own accumulated gradient of `param`, not yet reduced (a view, `param`'s shape):
        at stages 0 and 1 after a backward and before the reduction (inside `no_sync`, between the
        micro-batches of an accumulation), where DeepSpeed's `param.grad` holds it. None elsewhere."""
        return None

    def fragment_spans(self, param: torch.Tensor) -> list[tuple[int, int]] | None:
        """(offset, numel) of the part of `param` each rank of `fragment_group()` holds, in group-rank
        order; None when every rank holds all of it (nothing is partitioned)."""
        return None

    def fragment_group(self) -> object | None:
        """The process group `fragment_spans` counts ranks in (None: every rank)."""
        return None

    @abc.abstractmethod
    def ledger(self) -> MemoryLedger:
        """Every long-lived byte this strategy holds, by category and tier, plus transient peaks."""


def sum_over_ranks_grad_stats(grads: list[torch.Tensor], device: torch.device,
                              group: object | None = None) -> torch.Tensor:
    """[sum of squares of all `grads`, number of ranks whose grads hold inf/nan], summed over the
    ranks of `group` (None: all; the ranks that together hold every gradient once) in one 2-element
    all-reduce, so every rank takes the same decision (sharded stages).

    An inf or nan element makes the fp32 sum of squares inf or nan, so one pass over the gradients
    answers both (a separate isfinite pass doubled the cost: 3.5 s a step for 0.93B bf16 gradients on
    this CPU). A sum of squares that overflows fp32 from finite values counts as an overflow too,
    as in DeepSpeed, whose check sums the gradients."""
    if grads:
        sum_sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        stats = torch.stack([sum_sq, (~torch.isfinite(sum_sq)).to(torch.float32)])
    else:
        stats = torch.zeros(2)
    stats = stats.to(device)  # offloaded grads are on the host; NCCL reduces device tensors
    if comm.get_world_size(group) > 1:
        comm.all_reduce(stats, group=group)
    return stats


def clip_coefficient(sum_sq: float, loss_scale: float, max_norm: float) -> tuple[float, float]:
    """(global norm before clipping, 1/loss_scale x torch.nn.utils.clip_grad_norm_'s coefficient)."""
    total_norm = math.sqrt(sum_sq) / loss_scale
    coef = 1.0 / loss_scale
    if max_norm > 0:
        coef *= min(1.0, max_norm / (total_norm + 1e-6))
    return total_norm, coef


def step_grad(strategy: Strategy, grad: torch.Tensor, coef: float) -> torch.Tensor:
    """`grad` in the step's dtype (fp32, or bf16 with bf16 optimizer state) on the optimizer's
    device (a transient copy when it is not there in it), times `coef`."""
    converted = strategy.home.converted(grad, strategy.policy.step_dtype)  # the host when offloaded
    if converted is not grad:
        strategy.note_transient("step_grad_fp32" if converted.dtype == torch.float32 else "step_grad", converted)
    if coef != 1.0:
        converted.mul_(coef)
    return converted


@contextlib.contextmanager
def stepping_in(strategy: Strategy, params: list[torch.Tensor]) -> Iterator[None]:
    """Inside, the optimizer's `params` hold their values in the step's dtype: bf16 masters get an
    fp32 copy for fp32 optimizer state, rounded back into the master at exit (see [Note: bf16
    master weights] in precision.py). Otherwise it changes nothing."""
    dtype = strategy.policy.step_dtype
    homes = [p.data for p in params]
    if all(h.dtype == dtype for h in homes):
        yield
        return
    for p, home in zip(params, homes):
        p.data = home.to(dtype)
    strategy.note_transient("step_master_fp32", sum(p.numel() * p.element_size() for p in params))
    try:
        yield
    finally:
        for p, home in zip(params, homes):
            home.copy_(p.data)
            p.data = home


def elementwise_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Flat views of `param`'s optimizer state tensors that have one value per element (Adam's
    exp_avg, exp_avg_sq); scalar state (step) is per group and saved apart."""
    state = optimizer.state.get(param, {})
    return {k: v.view(-1) for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param.numel()}
