"""Async checkpoint saves: the state is copied to host memory, written by a background thread, and
committed on the main thread (`checkpoint.async_save`, `engine.save_checkpoint(..., async_save=True)`).

[Note: async checkpoint commit]
A sync save (save.py) stops training for the whole write: serialization, disk, fsync. An async save
splits save.py's steps between two threads:
1. On the main thread, in the time of a copy: the collective preamble (every rank called, same tag,
   the storage probe, an empty TAG.tmp), then `stage_save` with a copy into host memory: every piece's
   fp32 master and optimizer state, buffers and frozen parameters, the engine state and client_state
   (tensors copied, the rest deep-copied), the RNG states and meta.json's fields. On CUDA the copies are
   non_blocking into pinned buffers (reused from one save to the next) and an event marks their end;
   training's next kernels queue behind them on the same stream, so what is saved is this moment's
   state, whatever the next steps change.
2. On a writer thread: `write_staged`, the same code a sync save runs: each file created fresh in
   TAG.tmp, fsynced, and digested. The writer issues no collective: a collective from a second thread
   on the training process group would interleave with training's own, and gloo (and NCCL) pair calls
   by order, so it would deadlock or mix the two.
3. The commit, back on the main thread, with every rank there together: each rank's writer must be
   done, a failure on any rank is raised on every rank (comm's `on_every_rank` carries the error),
   then `commit_save` gathers the digests, a leader writes meta.json, renames TAG.tmp to TAG and
   replaces `latest`, as in a sync save. It runs at the first of:
   - an optimizer step's boundary (`poll`): one all_reduce of [writers done, writers failed] per step
     while a save is in flight; when every writer is done, or one failed, the commit runs there. So a
     failed write is raised at the next step, on every rank, and `latest` moves soon after the files
     are durable, not only at the next save;
   - the next save (at most one save is in flight per engine: its staging buffers are reused),
     `engine.wait_for_checkpoint()`, `engine.load_checkpoint()` and `engine.destroy()`, which wait for
     the writer and commit;
   - interpreter exit (comm/lifecycle.py's `before_exit_drain`), while the process group is still up.
     A script that destroys the process group first must call `engine.wait_for_checkpoint()` before:
     without collectives the ranks cannot agree, so the tag stays TAG.tmp and a warning says so. After
     an uncaught exception nothing is committed.
Crash safety is the sync save's ([Note: crash safety] in save.py): until the commit renames it,
everything is in TAG.tmp, and `latest` names the previous complete tag; a process killed mid-write
leaves that one loadable.
"""

from __future__ import annotations

import copy as copy_module
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerodp import comm
from zerodp.checkpoint.format import on_every_rank
from zerodp.checkpoint.save import StagedSave, Written, commit_save, open_save, stage_save, write_staged
from zerodp.comm.lifecycle import before_exit_drain
from zerodp.log import logger
from zerodp.zero.shard_state import ShardState


class HostStager:
    """Copies tensors into host memory for an async save: a clone on the CPU; on CUDA a non_blocking
    copy into a pinned buffer, reused by the next save of the same shapes (pinning is slow)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # pinned buffers no save holds
        self._held: list[torch.Tensor] = []  # the pinned buffers of the save being staged or written
        self._on_cuda = False  # a copy of this save was queued on a CUDA stream

    def begin(self) -> None:
        """A new save: the last save's buffers are free (it was committed before this one began)."""
        for buffer in self._held:
            self._free[(tuple(buffer.shape), buffer.dtype)].append(buffer)
        self._held, self._on_cuda = [], False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A compact host copy of `tensor` that later changes to it do not reach."""
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        free = self._free[(tuple(tensor.shape), tensor.dtype)]
        buffer = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buffer.copy_(tensor, non_blocking=True)
        self._held.append(buffer)
        self._on_cuda = True
        return buffer

    def copies_done(self) -> Callable[[], None]:
        """What the writer calls before it reads the copies: waits for the queued CUDA copies."""
        if not self._on_cuda:
            return lambda: None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize


def host_copy(obj: Any, copy: Callable[[torch.Tensor], torch.Tensor], what: str) -> Any:
    """`obj` (engine.pt's contents: dicts, lists, scalars, tensors) with every tensor copied by
    `copy` and everything else deep-copied, so later changes to the live objects do not reach it."""
    if isinstance(obj, torch.Tensor):
        return copy(obj)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, host_copy(v, copy, what)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(v, copy, what) for v in obj)
    try:
        return copy_module.deepcopy(obj)
    except Exception as err:  # noqa: BLE001 - named with the object that cannot be copied
        raise ValueError(f"an async checkpoint save copies {what} before training continues, and a "
                         f"{type(obj).__name__} in it cannot be copied ({err}); keep client_state to plain data "
                         "and tensors, or save with async_save=False") from err


@dataclass
class _PendingSave:
    """One async save between its staging and its commit."""

    staged: StagedSave
    thread: threading.Thread | None = None
    written: Written | None = None
    error: BaseException | None = None

    def write(self, copies_done: Callable[[], None]) -> None:
        """The writer thread's work: no collectives ([Note: async checkpoint commit])."""
        try:
            copies_done()
            self.written = write_staged(self.staged)
        except BaseException as err:  # noqa: BLE001 - kept for the commit, which raises it on every rank
            self.error = err
        finally:  # the host copies are on disk (or lost): free them now, not at the commit
            self.staged.rank_files, self.staged.engine_state, self.staged.rng = (), None, {}

    def result(self) -> Written:
        """The writer's result, or its error (with a note saying which save it was)."""
        if self.error is not None:
            if hasattr(self.error, "add_note"):
                self.error.add_note(f"raised by the background write of checkpoint {self.staged.target.tmp} "
                                    "(an async save); the previous checkpoint and `latest` are untouched")
            raise self.error
        if self.written is None:
            raise AssertionError(f"rank {comm.get_rank()}: the writer of {self.staged.target.tmp} ended without a result")
        return self.written


_in_flight: set["AsyncCheckpointer"] = set()
"""Checkpointers with a save in flight, held until it is committed even if their engine is dropped."""


class AsyncCheckpointer:
    """One engine's async saves: at most one in flight; see [Note: async checkpoint commit]."""

    def __init__(self) -> None:
        self._pending: _PendingSave | None = None
        self._stager = HostStager()

    @property
    def in_flight(self) -> bool:
        """Whether a save is staged and not yet committed."""
        return self._pending is not None

    def save(self, shard: ShardState, save_dir: str, tag: str | None, client_state: dict, save_latest: bool,
             exclude_frozen_parameters: bool) -> bool:
        """Stage `shard` into host memory and start writing it into `save_dir/tag` on a thread; the
        previous async save is committed first. Every rank must call it. Returns True."""
        self.wait()
        self._stager.begin()
        with comm.ledger.outside_step():
            target = open_save(shard, save_dir, tag, save_latest)
            try:
                staged = stage_save(shard, target, client_state, exclude_frozen_parameters, self._stager.copy)
                on_every_rank(lambda: self._copy_all(staged))  # a rank out of host memory: all raise
            except BaseException:
                target.discard()
                raise
        pending = _PendingSave(staged)
        pending.thread = threading.Thread(target=pending.write, args=(self._stager.copies_done(),),
                                          name=f"zerodp-checkpoint-writer-{target.tag}", daemon=True)
        self._pending = pending
        _in_flight.add(self)
        pending.thread.start()
        return True

    def _copy_all(self, staged: StagedSave) -> None:
        """Take every tensor the save writes to the host now (the pieces were a lazy generator)."""
        staged.rank_files = list(staged.rank_files)
        if staged.engine_state is not None:
            staged.engine_state = host_copy(staged.engine_state, self._stager.copy, "the engine state and client_state")

    def poll(self) -> None:
        """At an optimizer step's boundary, on every rank: commit the save in flight once every rank's
        writer is done, or raise on every rank when one failed (one small all_reduce per step)."""
        pending = self._pending
        if pending is None or pending.thread is None:
            return
        alive = pending.thread.is_alive()
        status = torch.tensor([0 if alive else 1, 1 if not alive and pending.error is not None else 0],
                              dtype=torch.int64, device=comm.device_for_backend())
        with comm.ledger.outside_step():
            comm.all_reduce(status)
        done, failed = status.tolist()
        if failed or done == comm.get_world_size():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written on every rank and committed (TAG renamed,
        `latest` replaced); a failed write raises here on every rank. Every rank must call it."""
        pending, self._pending = self._pending, None
        _in_flight.discard(self)
        if pending is None or pending.thread is None:
            return
        pending.thread.join()
        with comm.ledger.outside_step():
            try:
                written = on_every_rank(pending.result)
                commit_save(pending.staged, written)
            except BaseException:
                pending.staged.target.discard()  # every rank's writer has ended: on_every_rank came after join
                raise

    def finish_at_exit(self, failed: bool) -> None:
        """At interpreter exit: commit the save in flight while the process group is up."""
        pending = self._pending
        if pending is None:
            return
        tmp = pending.staged.target.tmp
        if failed:
            logger.warning("exiting after an error: the async checkpoint save into %s is not published", tmp)
            return
        if comm.is_initialized():
            self.wait()
            return
        if pending.thread is not None:
            pending.thread.join()
        self._pending = None
        logger.warning("the async checkpoint save into %s was written but not published: the process group was "
                       "destroyed before it was committed. Call engine.wait_for_checkpoint() before "
                       "torch.distributed.destroy_process_group()", tmp)


def _finish_all_at_exit(failed: bool) -> None:
    for checkpointer in list(_in_flight):
        checkpointer.finish_at_exit(failed)


before_exit_drain(_finish_all_at_exit)
