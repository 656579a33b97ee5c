"""The comm ledger: op, dtype, elements and bytes of every collective, per engine and per process.

Volumes follow the accounting of design.md §4, per rank, in elements of the collective's dtype: an
all-reduce of Ψ elements counts 2Ψ (a reduce-scatter Ψ plus an all-gather Ψ, which is what a
bandwidth-optimal all-reduce moves), a reduce-scatter counts its input, a reduce to one rank its
tensor, an all-gather its output, a broadcast its tensor, an all-to-all its input. A quantized collective
(ZeRO++ qwZ / qgZ, zerodp/zero/quantized_comm.py) is two collectives and counts what they send: the int8
payload and the fp32 scales, each under its own dtype (`all_gather[int8]` + `all_gather[float32]`).

[Note: one comm ledger per engine]
A process may hold several engines (RLHF's actor, critic, reference and reward models; a GAN's
generator and discriminator), each with its own optimizer steps. Every collective is counted twice:
in the process-wide `ledger` (what this rank sent, whoever asked; the exit drain, the estimator's
simulation and the benchmarks read it) and in the ledger of the engine that issued it, which
`engine.comm_report()` reads, so each engine's `last_step` is its own step cut at its own
boundaries. Which engine issued a collective is the innermost `recording(ledger)` block: the engine
enters it around forward, backward, step and checkpoints, api.initialize around its start-up, and a
strategy's autograd and module hooks enter it themselves (`records_to_own_ledger`), because a plain
`loss.backward()` never passes through the engine, and CUDA's backward runs on autograd's own
threads, which do not see the caller's context. A collective outside every block (a script's own
`zerodp.comm.all_reduce` between steps, a `GatheredParameters` block) counts for the engine that
entered one last: with one engine, that is every collective of the process, as before engines had
ledgers of their own.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections import defaultdict
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

# Elements moved per element of the tensor handed to the collective (design.md §4).
_TRAFFIC_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "reduce": 1, "all_gather": 1, "broadcast": 1,
                   "all_to_all": 1}


INTRA_NODE, INTER_NODE = "intra_node", "inter_node"
"""The two links a collective's bytes are counted on: its group lies within one node, or spans nodes."""


@dataclass
class CommRecord:
    """Totals for one (op, dtype) pair."""

    calls: int = 0
    numel: int = 0  # elements counted with the op's traffic factor
    bytes: int = 0
    # the same bytes by link (see `link_of`): a group within one node counts intra-node, else inter-node
    link_bytes: dict[str, int] = field(default_factory=dict)


_outside_step_depth = 0
"""Open `outside_step` blocks: while > 0 every ledger counts collectives as one-off work."""


@contextmanager
def outside_step() -> Iterator[None]:
    """Count the collectives inside as one-off work (a layout rebuild, a checkpoint), not as the
    step's traffic, in every ledger they are recorded in."""
    global _outside_step_depth
    _outside_step_depth += 1
    try:
        yield
    finally:
        _outside_step_depth -= 1


@dataclass
class CommLedger:
    """Counts collectives per optimizer step. `init` holds the start-up's, `one_off` the work done
    between steps (`outside_step`), `current` the step in progress.

    The engine calls `end_step()` at each accumulation boundary; `last_step` then holds the
    finished step's records and `current` starts empty.
    """

    current: dict[tuple[str, str], CommRecord] = field(default_factory=lambda: defaultdict(CommRecord))
    last_step: dict[tuple[str, str], CommRecord] = field(default_factory=dict)
    init: dict[tuple[str, str], CommRecord] = field(default_factory=dict)
    one_off: dict[tuple[str, str], CommRecord] = field(default_factory=lambda: defaultdict(CommRecord))

    def outside_step(self) -> AbstractContextManager[None]:
        """`outside_step()`: process-wide, so the engine's ledger and the process's agree."""
        return outside_step()

    def record(self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Count one collective of `op` on `tensor` (input for reduce ops, output for gathers) over
        `group` (None: every rank)."""
        records = self.one_off if _outside_step_depth else self.current
        entry = records[(op, str(tensor.dtype).removeprefix("torch."))]
        entry.calls += 1
        numel = tensor.numel() * _TRAFFIC_FACTOR[op]
        entry.numel += numel
        entry.bytes += numel * tensor.element_size()
        link = link_of(group)
        entry.link_bytes[link] = entry.link_bytes.get(link, 0) + numel * tensor.element_size()

    def end_init(self) -> None:
        """Close the start-up phase (parameter broadcast, rank checks)."""
        self.init = dict(self.current)
        self.current = defaultdict(CommRecord)

    def end_step(self) -> None:
        """Close one optimizer step."""
        self.last_step = dict(self.current)
        self.current = defaultdict(CommRecord)


ledger = CommLedger()
"""This process's ledger: every collective of this rank, whichever engine issued it."""


def comm_report(records: dict[tuple[str, str], CommRecord]) -> dict:
    """Plain-data view of a ledger phase: per op/dtype calls, elements and bytes (and bytes by link),
    plus totals, and `link_bytes`: {"intra_node": bytes, "inter_node": bytes} of every op together."""
    ops = {f"{op}[{dtype}]": {**vars(rec), "link_bytes": dict(rec.link_bytes)} for (op, dtype), rec in sorted(records.items())}
    return {
        "ops": ops,
        "total_numel": sum(r.numel for r in records.values()),
        "total_bytes": sum(r.bytes for r in records.values()),
        "link_bytes": {link: sum(r.link_bytes.get(link, 0) for r in records.values()) for link in (INTRA_NODE, INTER_NODE)},
    }


# ---------------------------------------------------------------------------------------------
# which engine's ledger a collective counts in (see [Note: one comm ledger per engine])

_active: contextvars.ContextVar[CommLedger | None] = contextvars.ContextVar("zerodp_comm_ledger", default=None)
"""The ledger of the engine whose forward, backward, step or hook is running in this context."""

_last_entered: weakref.ref[CommLedger] | None = None
"""The ledger entered last in this process: where a collective outside every block counts."""


def active_ledger() -> CommLedger | None:
    """The engine ledger the next collective counts in (None: only the process's ledger)."""
    current = _active.get()
    if current is not None:
        return current
    return None if _last_entered is None else _last_entered()


@contextmanager
def recording(engine_ledger: CommLedger) -> Iterator[None]:
    """Count the collectives issued inside in `engine_ledger` as well as in the process's `ledger`."""
    global _last_entered
    token = _active.set(engine_ledger)
    _last_entered = weakref.ref(engine_ledger)
    try:
        yield
    finally:
        _active.reset(token)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def records_to_own_ledger(method: _Method) -> _Method:
    """Decorate a method of an object that has a `comm_ledger` (an engine, a strategy): the
    collectives the method issues count in that ledger. For entry points and hooks (cheap: no
    generator, two context-variable writes)."""

    @functools.wraps(method)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _last_entered
        own = self.comm_ledger
        token = _active.set(own)
        _last_entered = weakref.ref(own)
        try:
            return method(self, *args, **kwargs)
        finally:
            _active.reset(token)

    return recorded  # type: ignore[return-value]


def end_init(engine_ledger: CommLedger) -> None:
    """Close an engine's start-up phase in its ledger and in the process's."""
    engine_ledger.end_init()
    if engine_ledger is not ledger:
        ledger.end_init()


def end_step(engine_ledger: CommLedger) -> None:
    """Close an engine's optimizer step in its ledger, and the process's step (cut at every engine's
    boundary, as before engines had ledgers of their own)."""
    engine_ledger.end_step()
    if engine_ledger is not ledger:
        ledger.end_step()


def record(op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Count one collective in the process's ledger and in the issuing engine's."""
    ledger.record(op, tensor, group)
    engine_ledger = active_ledger()
    if engine_ledger is not None and engine_ledger is not ledger:
        engine_ledger.record(op, tensor, group)


# ---------------------------------------------------------------------------------------------
# links

# [Note: links]
# Which collectives cross machines is what hierarchical partitioning (hpZ, MiCS) changes, so the
# ledger counts each collective's bytes on one of two links: intra-node when every rank of its group
# runs on one node, inter-node when the group spans nodes (then the whole volume is counted there: a
# ring over 2 nodes moves only part of it between them, but the bytes and the time both follow the
# slowest link). The node of each rank comes from `set_node_layout` (the engine gathers it at start);
# until then every group counts as intra-node.

_node_of_rank: tuple[int, ...] | None = None
_link_of_group: dict[Any, str] = {}


def set_node_layout(node_of_rank: list[int]) -> None:
    """Tell the ledger which node each global rank runs on (see [Note: links])."""
    global _node_of_rank
    _node_of_rank = tuple(node_of_rank)
    _link_of_group.clear()


def link_of(group: dist.ProcessGroup | None) -> str:
    """INTRA_NODE when every rank of `group` (None: all) is on one node, else INTER_NODE."""
    if _node_of_rank is None:
        return INTRA_NODE
    link = _link_of_group.get(group)
    if link is None:
        ranks = range(len(_node_of_rank)) if group is None else dist.get_process_group_ranks(group)
        link = INTRA_NODE if len({_node_of_rank[r] for r in ranks}) == 1 else INTER_NODE
        _link_of_group[group] = link
    return link
