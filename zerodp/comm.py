"""The only module that calls torch.distributed: process-group setup and every collective.

Each collective is recorded in a `CommLedger` (op, dtype, elements, bytes) so "how much did this
step communicate" is a query. Volumes follow the accounting of design.md §4, per rank, in elements
of the collective's dtype: an all-reduce of Ψ elements counts 2Ψ (a reduce-scatter Ψ plus an
all-gather Ψ, which is what a bandwidth-optimal all-reduce moves), a reduce-scatter counts its
input, a reduce to one rank its tensor, an all-gather its output, a broadcast its tensor.

Launch recipe (what `zerodp run` does for you):
    torchrun --standalone --nproc-per-node 2 train.py   # then zerodp.init_distributed() in train.py
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from zerodp import timers
from zerodp.log import logger

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout (DeepSpeed's 10 minutes); override with $ZERODP_TIMEOUT (seconds)."""

# Elements moved per element of the tensor handed to the collective (design.md §4).
_TRAFFIC_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "reduce": 1, "all_gather": 1, "broadcast": 1}


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


@dataclass
class CommLedger:
    """Counts collectives per optimizer step. `phase` is "init", then "step" after training starts.

    The engine calls `end_step()` at each accumulation boundary; `last_step` then holds the
    finished step's records and `current` starts empty.
    """

    current: dict[tuple[str, str], CommRecord] = field(default_factory=lambda: defaultdict(CommRecord))
    last_step: dict[tuple[str, str], CommRecord] = field(default_factory=dict)
    init: dict[tuple[str, str], CommRecord] = field(default_factory=dict)
    one_off: dict[tuple[str, str], CommRecord] = field(default_factory=lambda: defaultdict(CommRecord))
    _outside_step: bool = False

    @contextmanager
    def outside_step(self) -> Iterator[None]:
        """Count collectives inside as one-off work (a layout rebuild), not as the step's traffic."""
        self._outside_step = True
        try:
            yield
        finally:
            self._outside_step = False

    def record(self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Count one collective of `op` on `tensor` (input for reduce ops, output for gathers) over
        `group` (None: every rank)."""
        records = self.one_off if self._outside_step else self.current
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
"""This process's ledger. One process = one rank, so one ledger per rank."""


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


# ---------------------------------------------------------------------------------------------
# what the backend's threads still hold

# [Note: leaving nothing for interpreter shutdown]
# A collective's work object holds the tensors it was given. The backend's worker thread (gloo's
# runLoop, NCCL's watchdog) drops its reference after the work completes, so it, not Python, may
# release the last C++ reference to a tensor that has a Python object; that release takes the GIL.
# If it happens after the interpreter started finalising, taking the GIL calls pthread_exit, whose
# forced unwind meets a noexcept destructor: "terminate called without an active exception",
# SIGABRT (torch issue #190489). Seen in a core dump: AsyncBroadcastWork::~AsyncBroadcastWork ->
# TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread, while the main thread was in
# Py_FinalizeEx. The worker is that late because completing a work and dropping it are two steps,
# and on a busy machine the thread may not run between them before the script ends.
# So (1) every collective gets a fresh alias of its tensors, watched by a weak reference: the
# alias's Python object dies exactly when the last holder lets go; (2) an async collective returns
# a `Pending` that drops the work as soon as it is waited, so after `wait()` only the backend's
# thread can hold the alias; (3) at exit `drain_pending` waits for every Pending nobody waited
# for, then (with the GIL released) until no alias is left. A failed script waits at most a second
# and, if a collective can never finish (its peer is gone), leaves with os._exit: interpreter
# shutdown would otherwise join the backend's thread and wait for that collective's timeout.
# (4) The collectives other libraries issue (Accelerate's and TRL's gathers) go to torch.distributed
# directly, with no alias to watch; for those the exit then waits, the GIL released, until gloo's
# worker threads (torch names them "pt_gloo_runloop") have been off the CPU for two polls in a row,
# at most a few seconds: a worker that completed such a collective and has not dropped it yet is
# runnable, or waits for the GIL, which the polls' sleeps hand it. Seen once without it: a TRL GRPO
# run at stage 3 (tests/test_trl.py) aborted after its last line, on a machine busy with other tests.

_handed: set[weakref.ref] = set()
"""Weak references to the tensor aliases given to collectives whose work object still exists."""

_unwaited: weakref.WeakSet = weakref.WeakSet()
"""Async collectives (`Pending`) not waited for yet."""

DRAIN_TIMEOUT_S = 30.0
"""How long a finishing process waits for its collectives to be released (normally milliseconds)."""


def _handed_over(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of `tensor` (same storage) to give a collective; its weak reference's callback runs
    on whichever thread drops the work last."""
    alias = tensor.detach()
    _handed.add(weakref.ref(alias, _handed.discard))
    return alias


class Pending:
    """An async collective: `wait()` blocks until it is done, runs `then` (e.g. copies a result into
    place) and lets go of the backend's work objects. It may stand for several works (gloo's
    per-owner broadcasts and reduces). It holds the collective's `tensors` until waited for: a
    backend may keep them longer (gloo's threads drop their references when they get to it), none
    may free them sooner, and a simulated rank (zerodp/plan/simulate.py), whose collectives hold
    nothing, keeps them exactly that long too."""

    def __init__(self, works: list, then: Callable[[], object] | None = None, tensors: tuple = ()) -> None:
        self.works, self.then, self.tensors = works, then, tensors
        self.launched = timers.launched()  # its flight, for the step breakdown (zerodp/timers.py)
        _unwaited.add(self)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> bool:
        works, self.works = self.works, []  # see [Note: leaving nothing for interpreter shutdown]
        with _naming_lost_peers():
            for work in works:
                work.wait()
        if works:
            timers.in_flight(self.launched)
        if self.then is not None:
            self.then()
            self.then = None
        self.tensors = ()
        _unwaited.discard(self)
        return True


class PeerGone(RuntimeError):
    """A collective failed because another rank's process ended (crashed, killed, or left early)."""


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


@contextmanager
def _naming_lost_peers() -> Iterator[None]:
    """Turn the backend's "Connection closed by peer [addr]:port" into PeerGone naming the rank
    that is gone when it can be known (with two ranks, the other one). It wraps every collective
    call and wait: their time is the step breakdown's communication (zerodp/timers.py)."""
    try:
        with timers.waiting("communication"):
            yield
    except RuntimeError as err:
        if isinstance(err, PeerGone) or not any(marker in str(err) for marker in _PEER_LOST):
            raise
        world, rank = get_world_size(), get_rank()
        who = f"rank {1 - rank}" if world == 2 else "another rank (the launcher's log names the first to fail)"
        raise PeerGone(f"rank {rank}: {who} is gone, so this collective cannot finish; its own error is the "
                       f"one to read. Backend: {' '.join(str(err).split())[:300]}") from err


def free_after_wait(tensor: torch.Tensor) -> None:
    """Give a temporary's memory back now that the collective it was handed to has been waited for:
    its storage shrinks to nothing even while a backend thread still holds a reference (gloo drops
    its own when its thread gets to it), so the peak does not depend on that thread's timing. Only
    for tensors nothing else views."""
    tensor.untyped_storage().resize_(0)


def _pending(work: dist.Work | None, *tensors: torch.Tensor) -> Pending | None:
    """What an async torch collective on `tensors` becomes (a sync one returns None)."""
    return None if work is None else Pending([work], tensors=tensors)


def _finish(pending: Pending, async_op: bool) -> Pending | None:
    if async_op:
        return pending
    pending.wait()
    return None


def pending_collectives() -> int:
    """Tensors given to collectives that a work object still holds (0 once everything is released)."""
    return len(_handed)


def drain_pending(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait for every unwaited async collective, then until the backend's threads hold no tensor
    zerodp gave them; True when nothing is left within `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    for pending in list(_unwaited):
        while not pending.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        pending.wait()
    while _handed:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # releases the GIL, which the worker needs to release the alias
    return True


_BACKEND_THREADS = ("pt_gloo_runloop",)
"""The names of the backend's worker threads, which drop a collective's work after completing it."""


def _backend_thread_running() -> bool | None:
    """Whether one of the backend's worker threads is running or waiting for a CPU (Linux's /proc
    says; None where it cannot)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name in _BACKEND_THREADS and state == "R":
            return True
    return False


def settle_backend_threads(timeout_s: float) -> bool:
    """Wait, the GIL released, until no backend worker thread was running at two polls in a row
    (see [Note: leaving nothing for interpreter shutdown], (4)); False when `timeout_s` passed first."""
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
        running = _backend_thread_running()
        if running is None:
            return True
        quiet = 0 if running else quiet + 1
    return True


def _at_exit() -> None:
    failed = getattr(sys, "last_value", None) is not None  # the top-level handler of an uncaught error sets it
    if drain_pending(1.0 if failed else DRAIN_TIMEOUT_S):
        if dist.is_available() and dist.is_initialized() and not settle_backend_threads(0.5 if failed else 3.0):
            logger.debug("exiting while a backend thread is still busy")
        return
    logger.error("exiting with %d tensors still held by unfinished collectives (%d never waited for): "
                 "a peer is gone, or the ranks issued different collectives", len(_handed), len(_unwaited))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


atexit.register(_at_exit)


# ---------------------------------------------------------------------------------------------
# process group


def collective_timeout() -> datetime.timedelta:
    """The timeout given to every collective: $ZERODP_TIMEOUT seconds, default 600."""
    return datetime.timedelta(seconds=float(os.environ.get("ZERODP_TIMEOUT", DEFAULT_TIMEOUT_S)))


def default_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    **_deepspeed_only: object,
) -> None:
    """Initialise torch.distributed if it is not yet (DeepSpeed's `init_distributed`).

    Args:
        dist_backend: "nccl" or "gloo"; default nccl on CUDA, gloo on CPU.
        timeout: collective timeout; default $ZERODP_TIMEOUT or 600 s.
        init_method: torch's init_method; default env:// (set by torchrun / `zerodp run`).
        rank, world_size: explicit values; default from $RANK / $WORLD_SIZE.
    A script started without a launcher (no $RANK/$WORLD_SIZE) becomes a 1-rank job on a free
    local port. DeepSpeed-only arguments (auto_mpi_discovery, distributed_port, verbose, ...) are
    accepted and ignored.
    """
    if dist.is_initialized():
        return
    if rank < 0 and world_size < 0 and "RANK" not in os.environ and init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        rank, world_size = 0, 1
        logger.info("no launcher environment ($RANK unset): starting a 1-rank process group")
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timeout or collective_timeout()
    store = _restarted_elastic_store(timeout) if init_method is None and rank < 0 and world_size < 0 else None
    if store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout, rank=rank,
                            world_size=world_size, store=store)


def _restarted_elastic_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun after a restart (an elastic job lost a host, or a worker failed): the agent's
    store, under a prefix of its own for this attempt (None otherwise: torch's env:// as usual).

    torchrun's agent keeps one store for the job and hands it to every attempt's workers without a
    prefix, so the previous attempt's keys are still there: a restarted rank that reads its peers'
    gloo addresses before they rewrote them gets a dead process's address ("Gloo connectFullMesh
    failed ... Connection refused"; seen in tests/test_multihost.py's elastic test)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerodp/attempt_{attempt}", agent)


def is_initialized() -> bool:
    """True when torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """Rank in `group` (default: the world); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of `group` (default: the world); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def backend() -> str | None:
    """The default group's backend ("gloo", "nccl"), None without a process group."""
    return dist.get_backend() if is_initialized() else None


def device_for_backend() -> torch.device:
    """The device tensors must live on for the default group's collectives (a simulated rank's:
    `meta`, which stands for its accelerator)."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return simulated_device if simulated() else torch.device("cpu")


simulated_device = torch.device("meta")
"""The device a simulated rank trains on (zerodp/plan/simulate.py sets it): meta stands for a GPU."""


def simulated() -> bool:
    """True on the estimator's fake process group (zerodp/plan/simulate.py): collectives move no
    data, so checks that compare ranks' values have nothing to compare."""
    return is_initialized() and dist.get_backend() == "fake"


# ---------------------------------------------------------------------------------------------
# collectives (every call is recorded in `ledger`)

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
    ledger.record("all_reduce", tensor, group)
    with _naming_lost_peers():
        return _pending(dist.all_reduce(_handed_over(tensor), op=op, group=group, async_op=async_op), tensor)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Sum `tensor` over ranks into global rank `dst`'s copy (one owner's piece of a reduce-scatter)."""
    ledger.record("reduce", tensor, group)
    with _naming_lost_peers():
        return _pending(dist.reduce(_handed_over(tensor), dst=dst, group=group, async_op=async_op), tensor)


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """In-place broadcast of `tensor` from global rank `src`."""
    ledger.record("broadcast", tensor, group)
    with _naming_lost_peers():
        dist.broadcast(_handed_over(tensor), src=src, group=group)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Gather every rank's `input` into `output` (rank-major, world x input.numel()). `input` may
    be this rank's chunk of `output` (in place, as NCCL allows).

    On gloo, one broadcast per rank (see [Note: gloo collectives])."""
    ledger.record("all_gather", output, group)
    if not _is_gloo(group):
        with _naming_lost_peers():
            return _pending(_all_gather_single(_handed_over(output), _handed_over(input), group=group,
                                               async_op=async_op), output, input)
    chunks = output.view(-1).chunk(get_world_size(group))
    mine = chunks[get_rank(group)]
    if mine.data_ptr() != input.data_ptr():  # in place when `input` is already this rank's chunk
        mine.copy_(input.view(-1))
    works = [dist.broadcast(_handed_over(chunk), src=_global(group, r), group=group, async_op=True)
             for r, chunk in enumerate(chunks)]
    return _finish(Pending(works, tensors=(output, input)), async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Reduce `input` over ranks and keep this rank's slice in `output`.

    On gloo, one reduce per owner (see [Note: gloo collectives]); `input` is scratch afterwards."""
    ledger.record("reduce_scatter", input, group)
    if not _is_gloo(group):
        with _naming_lost_peers():
            return _pending(_reduce_scatter_single(_handed_over(output), _handed_over(input), op=op, group=group,
                                                   async_op=async_op), output, input)
    chunks = input.view(-1).chunk(get_world_size(group))
    works = [dist.reduce(_handed_over(chunk), dst=_global(group, r), op=op, group=group, async_op=True)
             for r, chunk in enumerate(chunks)]
    mine = chunks[get_rank(group)]
    return _finish(Pending(works, then=lambda: output.view(-1).copy_(mine), tensors=(output, input)), async_op)


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


def gather_messages(message: str | None, max_bytes: int = 2048) -> list[str | None]:
    """Every rank's error message (None: no error), so all ranks can raise the same one (a simulated
    rank's for every rank)."""
    if simulated():
        return [message] * get_world_size()
    data = (message or "").encode()[:max_bytes]
    row = torch.zeros(max_bytes + 1, dtype=torch.uint8, device=device_for_backend())
    row[0] = message is not None
    row[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else row[1:1]
    rows = all_gather_rows(row, group=None).cpu()
    return [bytes(r[1:].tolist()).rstrip(b"\0").decode(errors="replace") if r[0] else None for r in rows]


class PeerFailed(RuntimeError):
    """Another rank failed inside an `on_every_rank` block; carries its rank, error type and message."""

    def __init__(self, rank: int, error_type: str, message: str) -> None:
        super().__init__(f"rank {rank} failed with {error_type}: {message}")
        self.rank, self.error_type, self.message = rank, error_type, message


def on_every_rank(work: Callable[[], Any]) -> Any:
    """Run `work()` on every rank; if it raises on any rank, every rank raises at once: the failing
    rank its own exception, the others `PeerFailed` naming the first failing rank and its error.
    The one collective costs a 2 KiB gather; wrap per-rank work that can fail (files, user input)
    before the collective that would otherwise wait for the failed rank until the timeout."""
    result, problem = None, None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - every error is shared, then re-raised
        problem = err
    if get_world_size() == 1:
        if problem is not None:
            raise problem
        return result
    message = None if problem is None else f"{type(problem).__name__}\0{problem}"
    failed = [(r, m) for r, m in enumerate(gather_messages(message)) if m is not None]
    if problem is not None:
        raise problem
    if failed:
        rank, text = failed[0]
        error_type, _, detail = text.partition("\0")
        raise PeerFailed(rank, error_type, detail)
    return result


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of `ranks` (global ranks). Every rank must call it, for every group, in the
    same order (torch's rule), also ranks that are not in `ranks`."""
    return dist.new_group(ranks=ranks, timeout=collective_timeout())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank in `group` reaches this point."""
    if is_initialized():
        with _naming_lost_peers():
            dist.barrier(group=group)


def barrier_naming_missing_ranks() -> None:
    """A barrier that, on gloo, fails naming the ranks that did not arrive within the collective
    timeout instead of waiting on them forever (torch's monitored_barrier); a plain barrier on NCCL."""
    if get_world_size() == 1:
        return
    if backend() == "gloo":
        dist.monitored_barrier(timeout=collective_timeout(), wait_all_ranks=True)
    else:
        barrier()
