"""Process groups and the end of a process: setting up torch.distributed, the rank queries, and the
exit drain that leaves nothing for interpreter shutdown to tear down.

Launch recipe (what `zerodp run` does for you):
    torchrun --standalone --nproc-per-node 2 train.py   # then zerodp.init_distributed() in train.py
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from zerodp import timers
from zerodp.comm.launch_env import DEFAULT_MASTER_PORT, discover_launch_env
from zerodp.log import logger, show_on_stderr
from zerodp.ports import free_port

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout (DeepSpeed's 10 minutes); override with $ZERODP_TIMEOUT (seconds)."""


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
# (5) The same late release moves a measured peak (zerodp/plan/measure.py): a tensor Python dropped
# is freed when gloo's thread gets to it. Each collective takes the weak references of the aliases it
# handed over (`take_handed`), and in `settled_collectives` it returns only once they are dead.

_handed: set[weakref.ref] = set()
"""Weak references to the tensor aliases given to collectives whose work object still exists."""

unwaited: weakref.WeakSet = weakref.WeakSet()
"""Async collectives (`Pending`) not waited for yet."""

DRAIN_TIMEOUT_S = 30.0
"""How long a finishing process waits for its collectives to be released (normally milliseconds)."""


_this_collective = threading.local()
"""The weak references to the aliases handed over on this thread since the last `take_handed()`."""

_settling = False
"""Whether a finished collective waits for the backend to drop its aliases (`settled_collectives`)."""

SETTLE_TIMEOUT_S = 5.0
"""How long one collective waits for that at most, in settled mode (normally microseconds)."""


def handed_over(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of `tensor` (same storage) to give a collective; its weak reference's callback runs
    on whichever thread drops the work last."""
    alias = tensor.detach()
    ref = weakref.ref(alias, _handed.discard)
    _handed.add(ref)
    _taken().append(ref)
    return alias


def _taken() -> list[weakref.ref]:
    if not hasattr(_this_collective, "refs"):
        _this_collective.refs = []
    return _this_collective.refs


def take_handed() -> list[weakref.ref]:
    """The aliases handed over on this thread since the last call: one collective's, taken by it."""
    refs = _taken()
    _this_collective.refs = []
    return refs


def settle(refs: list[weakref.ref]) -> None:
    """In settled mode, wait (the GIL released) until the backend has dropped these aliases of a
    finished collective; elsewhere return at once."""
    if not _settling:
        return
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while any(ref() is not None for ref in refs):
        if time.monotonic() > deadline:
            logger.warning("a finished collective's tensors were still held after %.0f s: the measured "
                           "memory counts them until they are let go", SETTLE_TIMEOUT_S)
            return
        time.sleep(0.0002)


@contextmanager
def settled_collectives() -> Iterator[None]:
    """Inside, a collective returns (or its `Pending.wait()` does) only once the backend's thread has
    let go of the tensors it was given (microseconds after the collective ends), so each is freed
    exactly when Python drops it, as the estimator's simulation assumes. Without it, on a busy machine
    gloo's thread drops a finished collective's tensors a little later, and a measured peak came out up
    to 129,056 bytes above the same run's exact figure (tests/test_estimate_sp.py, Ulysses at S = 2).
    For measurements only (zerodp/plan/measure.py): it costs each collective a wait for that thread."""
    global _settling
    before, _settling = _settling, True
    take_handed()  # what a collective that raised before left behind (the same at the end)
    try:
        yield
    finally:
        _settling = before
        take_handed()


def pending_collectives() -> int:
    """Tensors given to collectives that a work object still holds (0 once everything is released)."""
    return len(_handed)


def drain_pending(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait for every unwaited async collective, then until the backend's threads hold no tensor
    zerodp gave them; True when nothing is left within `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    for pending in list(unwaited):
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


_before_drain: list[Callable[[bool], None]] = []
"""Work that must finish at exit before the drain, while the process group is still up (an async
checkpoint's commit): each is called with whether the script failed."""


def before_exit_drain(hook: Callable[[bool], None]) -> None:
    """Call `hook(failed)` at interpreter exit, before the drain of collectives (`failed`: the script
    ended with an uncaught exception). A hook may issue collectives; its errors are logged."""
    _before_drain.append(hook)


def _at_exit() -> None:
    failed = getattr(sys, "last_value", None) is not None  # the top-level handler of an uncaught error sets it
    for hook in _before_drain:
        try:
            hook(failed)
        except Exception:  # noqa: BLE001 - an exit has no caller left to raise to
            logger.exception("at exit: %s failed", getattr(hook, "__qualname__", hook))
    if drain_pending(1.0 if failed else DRAIN_TIMEOUT_S):
        if dist.is_available() and dist.is_initialized() and not settle_backend_threads(0.5 if failed else 3.0):
            logger.debug("exiting while a backend thread is still busy")
        return
    logger.error("exiting with %d tensors still held by unfinished collectives (%d never waited for): "
                 "a peer is gone, or the ranks issued different collectives", len(_handed), len(unwaited))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


atexit.register(_at_exit)


# ---------------------------------------------------------------------------------------------
# a worker dies with its launcher

# [Note: workers die with their launcher]
# torchrun's agent (in-process in `zerodp run`, `zerodp deepspeed` and `zerodp demo`) starts each worker
# in a session of its own (start_new_session=True), and `zerodp compare` spawns its ranks with
# multiprocessing. The agent stops its workers when it is told to (SIGTERM, SIGINT, a timeout's
# SIGTERM), but a SIGKILL, an OOM kill or a crash of the launcher leaves them running: no terminal,
# no process group and no parent reaps them (133 orphaned demo ranks once). Linux's
# prctl(PR_SET_PDEATHSIG, SIGKILL) makes the kernel kill a process when the thread that forked it
# exits, however it exits; only the child can ask for it, and torch gives no hook between its fork and
# exec. So the launchers put their pid in $ZERODP_LAUNCHER_PID (`workers_die_with_me`) and the worker
# asks for it itself, when it imports zerodp (this module is imported by `import zerodp` and
# `import deepspeed` under ZERODP_AS_DEEPSPEED, both before a script's first collective):
# - a direct child of the launcher arms the signal, then checks its parent again: a launcher that died
#   between the fork and the prctl is not seen by the kernel, so a changed parent means exit now;
# - any other process that inherited the variable (a DataLoader worker, a compile subprocess, a tool
#   the script runs) leaves it alone while the launcher lives; its own parent manages it;
# - when the launcher is already gone, the process exits with a line that names the variable.
# The forking thread is the agent's main thread (torchrun) or the launcher's (compare), which live as
# long as the launch. torch's multiprocessing spawn (compare) asks for SIGINT itself, after the import;
# compare's ranks arm SIGKILL again (zerodp/report/launch.py): a SIGINT can be caught, and waits while
# the rank is blocked in a collective. Elsewhere than Linux this is a no-op. A worker that never imports zerodp (a plain
# torch script under `zerodp run`) is not covered: torchrun still stops it on SIGTERM and SIGINT.

LAUNCHER_PID_ENV = "ZERODP_LAUNCHER_PID"
"""Set by zerodp's launchers to their pid: their workers die with them ([Note: workers die with their launcher])."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextmanager
def workers_die_with_me() -> Iterator[None]:
    """Processes this process starts inside the block die with it once they import zerodp: sets
    $ZERODP_LAUNCHER_PID to this pid for the block ([Note: workers die with their launcher])."""
    before = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = before


def die_with_launcher() -> None:
    """When $ZERODP_LAUNCHER_PID names this process's parent, the kernel kills this process when the
    parent dies (PR_SET_PDEATHSIG, Linux only); exits at once when that launcher is already gone.
    Called when zerodp is imported ([Note: workers die with their launcher])."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    launcher_pid = int(launcher)
    if os.getppid() == launcher_pid:
        _set_parent_death_signal(signal.SIGKILL)
        if os.getppid() == launcher_pid:  # armed while the launcher lived: the kernel does the rest
            return
    elif _process_exists(launcher_pid):
        return  # a descendant of a worker, not a worker: its own parent manages it
    sys.stderr.write(f"zerodp: the launcher that started this process (pid {launcher_pid}, "
                     f"${LAUNCHER_PID_ENV}) is gone; exiting\n")
    sys.stderr.flush()
    os._exit(1)


def _set_parent_death_signal(sig: signal.Signals) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker may outlive its launcher",
                       ctypes.get_errno())


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


die_with_launcher()


# ---------------------------------------------------------------------------------------------
# a peer that is gone (every collective call and wait is wrapped in `naming_lost_peers`)


class PeerGone(RuntimeError):
    """A collective failed because another rank's process ended (crashed, killed, or left early)."""


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


@contextmanager
def naming_lost_peers() -> Iterator[None]:
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


# ---------------------------------------------------------------------------------------------
# process group


def collective_timeout() -> datetime.timedelta:
    """The timeout given to every collective: $ZERODP_TIMEOUT seconds, default 600."""
    return datetime.timedelta(seconds=float(os.environ.get("ZERODP_TIMEOUT", DEFAULT_TIMEOUT_S)))


def default_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = DEFAULT_MASTER_PORT,
    **_deepspeed_only: object,
) -> None:
    """Initialise torch.distributed if it is not yet (DeepSpeed's `init_distributed`).

    Args:
        dist_backend: "nccl" or "gloo"; default nccl on CUDA, gloo on CPU.
        timeout: collective timeout; default $ZERODP_TIMEOUT or 600 s.
        init_method: torch's init_method; default env:// (set by torchrun / `zerodp run`).
        rank, world_size: explicit values; default from the launcher's environment.
        distributed_port: the master port of a Slurm or MPI launch without $MASTER_PORT (default 29500).
    The launcher is found from the environment (comm/launch_env.py's [Note: launch sources]):
    torchrun's $RANK / $WORLD_SIZE, else Open MPI's or MPICH's mpirun, else Slurm's srun, whose
    rank, size, local rank and master are exported as torchrun's variables; the log says which.
    A script started without a launcher becomes a 1-rank job on a free local port. DeepSpeed-only
    arguments (auto_mpi_discovery, verbose, ...) are accepted and ignored.
    """
    if dist.is_initialized():
        return
    if rank < 0 and world_size < 0 and init_method is None:
        rank, world_size = _from_launcher(distributed_port)
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timeout or collective_timeout()
    store = _restarted_elastic_store(timeout) if init_method is None and rank < 0 and world_size < 0 else None
    if store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout, rank=rank,
                            world_size=world_size, store=store)
    if backend == "gloo":
        share_cores()


def share_cores() -> None:
    """Give each of this machine's CPU ranks its share of the cores, as torchrun's OMP_NUM_THREADS=1
    does for the processes it starts. Ranks started otherwise (mp.spawn, a process pool: DeepSpeed's
    test harness) keep torch's default of every core each, so N ranks run N x cores spinning OpenMP
    threads: 6.5x slower steps with 2 ranks on 2 busy cores (measured). Only when OMP_NUM_THREADS is
    unset and the launcher says how many ranks share the machine ($LOCAL_WORLD_SIZE, DeepSpeed's
    $LOCAL_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    if "OMP_NUM_THREADS" in os.environ or not (local or "").isdigit() or int(local) < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // int(local))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
        logger.info("%s ranks share this machine's %d cores: %d torch thread(s) each (set OMP_NUM_THREADS "
                    "to choose)", local, cores, share)


def _from_launcher(distributed_port: int) -> tuple[int, int]:
    """Read the launcher's environment, export a Slurm or MPI launch as torchrun's variables, and
    return the (rank, world_size) to pass to torch: (0, 1) without a launcher, else (-1, -1) (env://)."""
    launch = discover_launch_env(os.environ, distributed_port)
    if launch.source == "none":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        logger.info("no launcher environment ($RANK, $OMPI_COMM_WORLD_RANK, $PMI_RANK, $SLURM_PROCID unset): "
                    "starting a 1-rank process group")
        return 0, 1
    if launch.source == "torchrun":  # the usual case, and torch reads its own variables: no line for it
        logger.debug(launch.describe())
        return -1, -1
    os.environ.update(launch.exports())
    show_on_stderr()  # which launcher was believed is worth seeing before anything can hang
    logger.info(launch.describe())
    return -1, -1


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
"""The device a simulated rank trains on (`set_simulated_device`): meta stands for a GPU."""


def set_simulated_device(device: torch.device) -> None:
    """The device a simulated rank trains on (zerodp/plan/simulate.py: meta for a GPU, cpu for a
    CPU-only run)."""
    global simulated_device
    simulated_device = device


def simulated() -> bool:
    """True on the estimator's fake process group (zerodp/plan/simulate.py): collectives move no
    data, so checks that compare ranks' values have nothing to compare."""
    return is_initialized() and dist.get_backend() == "fake"


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of `ranks` (global ranks). Every rank must call it, for every group, in the
    same order (torch's rule), also ranks that are not in `ranks`."""
    return dist.new_group(ranks=ranks, timeout=collective_timeout())
