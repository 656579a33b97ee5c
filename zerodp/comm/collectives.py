"""The collectives: every call goes through here, is counted in the comm ledger (zerodp/comm/ledger.py),
hands the backend an alias the exit drain can watch (zerodp/comm/lifecycle.py), and turns a peer's
death into `PeerGone`. This package is the only caller of torch.distributed's collectives.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from zerodp import timers
from zerodp.comm.ledger import record
from zerodp.comm.lifecycle import (
    handed_over,
    naming_lost_peers,
    settle,
    take_handed,
    unwaited,
    get_rank,
    get_world_size,
    is_initialized,
)


class Pending:
    """An async collective: `wait()` blocks until it is done, runs `then` (e.g. copies a result into
    place) and lets go of the backend's work objects. It may stand for several works (gloo's
    per-owner broadcasts and reduces). It holds the collective's `tensors` until waited for: a
    backend may keep them longer (gloo's threads drop their references when they get to it), none
    may free them sooner, and a simulated rank (zerodp/plan/simulate.py), whose collectives hold
    nothing, keeps them exactly that long too."""

    def __init__(self, works: list, then: Callable[[], object] | None = None, tensors: tuple = ()) -> None:
        self.works, self.then, self.tensors = works, then, tensors
        self.handed = take_handed()
        self.launched = timers.launched()  # its flight, for the step breakdown (zerodp/timers.py)
        unwaited.add(self)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> bool:
        works, self.works = self.works, []  # see [Note: leaving nothing for interpreter shutdown]
        if works:
            with naming_lost_peers():
                while works:
                    works.pop().wait()  # and dropped: no local holds a work while `settle` waits
            timers.in_flight(self.launched)
        settle(self.handed)
        self.handed = []
        if self.then is not None:
            self.then()
            self.then = None
        self.tensors = ()
        unwaited.discard(self)
        return True


def free_after_wait(tensor: torch.Tensor) -> None:
    """Give a temporary's memory back now that the collective it was handed to has been waited for:
    its storage shrinks to nothing even while a backend thread still holds a reference (gloo drops
    its own when its thread gets to it), so the peak does not depend on that thread's timing. Only
    for tensors nothing else views."""
    tensor.untyped_storage().resize_(0)


def _pending(work: dist.Work | None, *tensors: torch.Tensor) -> Pending | None:
    """What an async torch collective on `tensors` becomes (a sync one returns None)."""
    if work is None:
        settle(take_handed())
        return None
    return Pending([work], tensors=tensors)


def _finish(pending: Pending, async_op: bool) -> Pending | None:
    if async_op:
        return pending
    pending.wait()
    return None


# ---------------------------------------------------------------------------------------------
# collectives (every call is recorded: `record`)

# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.4 has only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """In-place all-reduce of `tensor` over `group`."""
    record("all_reduce", tensor, group)
    with naming_lost_peers():
        return _pending(dist.all_reduce(handed_over(tensor), op=op, group=group, async_op=async_op), tensor)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Sum `tensor` over ranks into global rank `dst`'s copy (one owner's piece of a reduce-scatter)."""
    record("reduce", tensor, group)
    with naming_lost_peers():
        return _pending(dist.reduce(handed_over(tensor), dst=dst, group=group, async_op=async_op), tensor)


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """In-place broadcast of `tensor` from global rank `src`."""
    record("broadcast", tensor, group)
    with naming_lost_peers():
        dist.broadcast(handed_over(tensor), src=src, group=group)
    settle(take_handed())


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Gather every rank's `input` into `output` (rank-major, world x input.numel()). `input` may
    be this rank's chunk of `output` (in place, as NCCL allows).

    On gloo, one broadcast per rank (see [Note: gloo collectives])."""
    record("all_gather", output, group)
    if not _is_gloo(group):
        with naming_lost_peers():
            return _pending(_all_gather_single(handed_over(output), handed_over(input), group=group,
                                               async_op=async_op), output, input)
    chunks = output.view(-1).chunk(get_world_size(group))
    mine = chunks[get_rank(group)]
    if mine.data_ptr() != input.data_ptr():  # in place when `input` is already this rank's chunk
        mine.copy_(input.view(-1))
    pending = Pending([dist.broadcast(handed_over(chunk), src=_global(group, r), group=group, async_op=True)
                       for r, chunk in enumerate(chunks)], tensors=(output, input))
    return _finish(pending, async_op)  # no local holds the works: settled mode waits for their release


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Reduce `input` over ranks and keep this rank's slice in `output`.

    On gloo, one reduce per owner (see [Note: gloo collectives]); `input` is scratch afterwards."""
    record("reduce_scatter", input, group)
    if not _is_gloo(group):
        with naming_lost_peers():
            return _pending(_reduce_scatter_single(handed_over(output), handed_over(input), op=op, group=group,
                                                   async_op=async_op), output, input)
    chunks = input.view(-1).chunk(get_world_size(group))
    mine = chunks[get_rank(group)]
    pending = Pending([dist.reduce(handed_over(chunk), dst=_global(group, r), op=op, group=group, async_op=True)
                       for r, chunk in enumerate(chunks)], then=lambda: output.view(-1).copy_(mine),
                      tensors=(output, input))
    return _finish(pending, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Split `input` into world equal chunks along dim 0, send chunk r to rank r of `group`, and
    write the chunk received from rank r as chunk r of `output` (same shape as `input`). The ledger
    counts `input`: every element handed over, the 1/world that stays on this rank included."""
    record("all_to_all", input, group)
    with naming_lost_peers():
        return _pending(dist.all_to_all_single(handed_over(output), handed_over(input), group=group,
                                               async_op=async_op), output, input)


# [Note: gloo collectives]
# gloo's reduce_scatter and all_gather are 1.5-5x slower than the same traffic sent as one reduce
# (or broadcast) per owner: measured on 23.2M fp32 elements, 2 / 4 ranks on one machine,
# reduce_scatter 154 / 283 ms vs per-owner reduces 119 / 114 ms, all_gather 124 / 301 ms vs
# broadcasts 49 / 60 ms (all_reduce: 98 / 140 ms). Each rank moves the same bytes either way, so the
# ledger records them under the collective they implement. NCCL gets its native collectives.


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather one small 1-D `row` from every rank into a (world, len) tensor (rank checks)."""
    out = torch.empty(get_world_size(group), row.numel(), dtype=row.dtype, device=row.device)
    all_gather_into_tensor(out.view(-1), row, group=group)
    return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank in `group` reaches this point."""
    if is_initialized():
        with naming_lost_peers():
            dist.barrier(group=group)
