"""Named tensors in swap files on NVMe, the preflight checks before them, and a bandwidth probe.

    check_nvme_path(path, needed_bytes, key=OPTIMIZER_NVME_PATH_KEY)     # before anything is written
    with SwapStore(path, key=OPTIMIZER_NVME_PATH_KEY, engine=AsyncFileIO.from_aio_config(aio)) as store:
        store.allocate("exp_avg.0", numel, torch.float32)
        store.write("exp_avg.0", buffer).wait()
        store.read("exp_avg.0", buffer).wait()

[Note: swap folder layout]
Each store makes `<nvme_path>/zerodp-swap-<hostname>-<pid>-<uuid>/rank<r>/swap.bin`: the hostname
and pid say whose it is, the uuid keeps two stores of one process (and a reused pid) apart, and the
rank folder keeps ranks apart when several share a disk. All of a store's tensors live in that one
file at offsets rounded up to 4096 bytes, rather than one file per tensor: a store holds hundreds
of tensors (sub-groups x Adam states), and one file needs one descriptor instead of hundreds (the
usual limit is 1024), one posix_fallocate per tensor extends it, and cleanup is one folder. Regions
are never freed: a run swaps a fixed set of tensors for its whole life.

[Note: cleanup and SIGKILL]
`close()`, leaving a `with` block (normally or by an exception), garbage collection and interpreter
exit (weakref.finalize runs at exit) all delete the run folder, in the process that made it only (a
forked child that collects its copy of the store must not delete its parent's files). A process
killed by SIGKILL (or the OOM killer, or a power cut) runs none of that, and its files stay. To find
them later each run folder holds `.lock`, locked with flock(2) for the store's life; the kernel
drops the lock when the process dies however it dies, so a folder whose lock can be taken belongs to
a dead run. `remove_stale_swap_dirs` deletes those (of this host only: flock may not be shared
between hosts on a network filesystem), and a new store calls it first by default, so leftovers
neither collide with nor eat the space of a new run. A folder becomes visible under its final name
only once its lock is held (it is made under a hidden name and renamed), so a run starting next to
us is never mistaken for a dead one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch

from zerodp.log import global_rank, log_rank0, logger
from zerodp.sizes import format_bytes
from zerodp.offload.aio import (
    ALIGN_BYTES, AsyncFileIO, IOHandle, IOStats, SwapIOError, aligned_empty, bandwidth_MBps,
    open_swap_file, probe_direct_io, round_up,
)

OPTIMIZER_NVME_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_NVME_PATH_KEY = "zero_optimization.offload_param.nvme_path"
SWAP_DIR_PREFIX = "zerodp-swap-"
_LOCK_NAME = ".lock"
_RUN_DIR_NAME = re.compile(rf"{SWAP_DIR_PREFIX}(?P<host>.+)-(?P<pid>\d+)-(?P<uuid>[0-9a-f]{{12}})")
_logged_modes: set[tuple[str, bool]] = set()


# ---------------------------------------------------------------------------------------------
# Preflight
# ---------------------------------------------------------------------------------------------


def _show(num_bytes: int) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes} bytes)"


def disk_free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the filesystem of `path` (statvfs f_bavail)."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def check_nvme_path(nvme_path: str | os.PathLike | None, needed_bytes: int = 0, *,
                    key: str = OPTIMIZER_NVME_PATH_KEY) -> int:
    """Check, before anything is written, that `nvme_path` is an existing, writable folder with
    room for `needed_bytes` (default 0). `key` is the config key named in the ValueError raised
    otherwise. Returns the bytes available there."""
    if not nvme_path:
        raise ValueError(f"{key} is not set but the offload device is 'nvme'; set {key} to a folder on a local "
                         "NVMe disk")
    path = Path(nvme_path)
    if not path.exists():
        raise ValueError(f"{key}={str(path)!r} does not exist; create it (mkdir -p {path}) or set {key} to an "
                         "existing folder on a local NVMe disk")
    if not path.is_dir():
        raise ValueError(f"{key}={str(path)!r} is not a folder; set {key} to a folder on a local NVMe disk")
    probe = path / f".zerodp-write-probe-{uuid.uuid4().hex}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{key}={str(path)!r} is not writable by this process (user id {os.geteuid()}: "
                         f"{err.strerror}); fix the folder's permissions or set {key} to a writable folder") from err
    available = disk_free_bytes(path)
    if needed_bytes > available:
        raise ValueError(f"{key}={str(path)!r} has {_show(available)} free but this run will write "
                         f"{_show(needed_bytes)} there; free space on that disk, set {key} to a larger disk, "
                         "or offload less (more data-parallel ranks, or device 'cpu')")
    return available


def mem_available_bytes(meminfo_path: str = "/proc/meminfo") -> Optional[int]:
    """Host memory available to new allocations without swapping (MemAvailable), or None if unknown."""
    try:
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                match = re.fullmatch(r"MemAvailable:\s+(\d+)\s+kB\s*", line)
                if match:
                    return int(match.group(1)) * 1024
    except OSError:
        pass
    return None


def check_host_memory(needed_bytes: int, *, what: str, fix: str, meminfo_path: str = "/proc/meminfo") -> Optional[int]:
    """Raise ValueError when `what` (e.g. "offload_optimizer's 4 pinned swap buffers") needs more
    host memory than MemAvailable; `fix` says how to need less. Returns the bytes available, or
    None (and checks nothing) when /proc/meminfo cannot tell."""
    available = mem_available_bytes(meminfo_path)
    if available is None:
        logger.debug("host memory check skipped: no MemAvailable in %s", meminfo_path)
        return None
    if needed_bytes > available:
        raise ValueError(f"{what} needs {_show(needed_bytes)} of host memory but only {_show(available)} is available "
                         f"(MemAvailable in {meminfo_path}); {fix}")
    return available


# ---------------------------------------------------------------------------------------------
# Swap folders
# ---------------------------------------------------------------------------------------------


def _host_tag() -> str:
    """This host's name, restricted to characters that are safe in a folder name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def remove_stale_swap_dirs(nvme_path: str | os.PathLike) -> list[Path]:
    """Delete this host's swap folders under `nvme_path` whose run is dead (its `.lock` can be
    locked: see [Note: cleanup and SIGKILL]). Returns the folders removed."""
    removed = []
    for run_dir in sorted(Path(nvme_path).glob(f"{SWAP_DIR_PREFIX}*")):
        match = _RUN_DIR_NAME.fullmatch(run_dir.name)
        if match is None or match.group("host") != _host_tag():
            continue  # another host's run ("a-*" also matches host "a-b"'s folders, hence the parse)
        try:
            lock_fd = os.open(run_dir / _LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # not a folder of ours, or already gone
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            continue  # locked: its run is alive
        shutil.rmtree(run_dir, ignore_errors=True)
        os.close(lock_fd)
        removed.append(run_dir)
    if removed:
        logger.warning("removed %d swap folder(s) left by runs that were killed: %s",
                       len(removed), ", ".join(map(str, removed)))
    return removed


def _make_run_dir(nvme_path: Path) -> tuple[Path, int]:
    """Create and lock this store's run folder; returns (folder, lock descriptor)."""
    final = nvme_path / f"{SWAP_DIR_PREFIX}{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    hidden = nvme_path / f".zerodp-new-{uuid.uuid4().hex}"
    hidden.mkdir(mode=0o700)
    try:
        lock_fd = os.open(hidden / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(hidden, final)
    except BaseException:
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    return final, lock_fd


class _Cleanup:
    """Deletes a store's files; held by weakref.finalize, so it must not refer to the store."""

    def __init__(self, run_dir: Path, lock_fd: int) -> None:
        self.run_dir = run_dir
        self.fds = [lock_fd]  # closed last to first: the swap file, then the lock
        self.owner_pid = os.getpid()

    def __call__(self) -> None:
        for fd in self.fds[:0:-1]:
            _close_quietly(fd)
        if os.getpid() == self.owner_pid:  # a forked child (a DataLoader worker) only drops its copies
            shutil.rmtree(self.run_dir, ignore_errors=True)
        _close_quietly(self.fds[0])


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class RegionState(Enum):
    """What a tensor's file region holds."""

    ALLOCATED = "allocated"  # reserved, never written: reading it is a bug
    WRITING = "writing"  # a write is in flight
    VALID = "valid"  # the last write completed: reads allowed
    FAILED = "failed"  # the last write failed: the region is incomplete, reads raise


@dataclass
class SwapRegion:
    """One named tensor's place in the swap file."""

    name: str
    file_offset: int  # a multiple of ALIGN_BYTES
    numel: int
    dtype: torch.dtype
    state: RegionState = RegionState.ALLOCATED
    num_reads_in_flight: int = 0
    error: Optional[BaseException] = None  # the failed write's error, while FAILED

    @property
    def num_bytes(self) -> int:
        """The tensor's bytes."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class SwapStore:
    """Named tensors in one swap file under `nvme_path` (see [Note: swap folder layout]).

    Creating one removes dead runs' folders (`remove_stale=True`), runs `check_nvme_path` for
    `expected_bytes` (default 0) naming `key` in errors, makes this rank's folder (`rank` defaults
    to the global rank) and uses O_DIRECT when the filesystem allows it and `direct_io` (default
    True; False forces buffered I/O). I/O runs on `engine` (default: a private AsyncFileIO with
    DeepSpeed's aio defaults, closed with the store; a passed engine is left open).
    """

    def __init__(self, nvme_path: str | os.PathLike, *, key: str = OPTIMIZER_NVME_PATH_KEY,
                 expected_bytes: int = 0, rank: Optional[int] = None, direct_io: bool = True,
                 engine: Optional[AsyncFileIO] = None, remove_stale: bool = True) -> None:
        self.key = key
        if remove_stale and nvme_path and Path(nvme_path).is_dir():
            remove_stale_swap_dirs(nvme_path)
        check_nvme_path(nvme_path, expected_bytes, key=key)
        self.run_directory, lock_fd = _make_run_dir(Path(nvme_path))
        self._cleanup = _Cleanup(self.run_directory, lock_fd)
        self._finalizer = weakref.finalize(self, self._cleanup)
        try:
            self.directory = self.run_directory / f"rank{global_rank() if rank is None else rank}"
            self.directory.mkdir()
            direct = direct_io and probe_direct_io(str(self.directory))
            self._file = open_swap_file(str(self.directory / "swap.bin"), direct=direct)
            self._cleanup.fds.append(self._file.fd)
        except BaseException:
            self._finalizer()
            raise
        _log_mode_once(str(nvme_path), direct, forced=not direct_io)
        self._owns_engine = engine is None
        self.engine = engine if engine is not None else AsyncFileIO()
        self._regions: dict[str, SwapRegion] = {}
        self._end_bytes = 0  # file bytes reserved so far
        self._cond = threading.Condition()  # guards region states and _num_in_flight
        self._num_in_flight = 0
        self._closed = False

    # -- properties ---------------------------------------------------------------------------

    @property
    def file_path(self) -> Path:
        """The swap file."""
        return Path(self._file.path)

    @property
    def direct_io(self) -> bool:
        """Whether the swap file was opened with O_DIRECT."""
        return self._file.direct

    @property
    def allocated_bytes(self) -> int:
        """File bytes reserved by allocate (each region rounded up to 4096 bytes)."""
        return self._end_bytes

    @property
    def counters(self) -> IOStats:
        """Bytes read/written and busy seconds of the engine (shared if the engine is)."""
        return self.engine.counters.snapshot()

    def state(self, name: str) -> RegionState:
        """What the region of tensor `name` holds now."""
        return self._region(name).state

    # -- allocate, write, read ----------------------------------------------------------------

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Reserve disk space for tensor `name` of `numel` elements of `dtype`.

        The space is reserved now (posix_fallocate), so a disk too small fails here, not in a
        step; raises SwapIOError naming the tensor and the path if it does.
        """
        self._check_open()
        if name in self._regions:
            raise ValueError(f"swap tensor {name!r} is already allocated in {self.file_path}; use another name")
        if numel < 0:
            raise ValueError(f"swap tensor {name!r}: numel={numel} must be >= 0")
        with self._cond:  # allocate may be called from several threads: offsets must not overlap
            region = SwapRegion(name, self._end_bytes, numel, dtype)
            padded_bytes = round_up(region.num_bytes, ALIGN_BYTES)
            if padded_bytes:
                self._reserve(region, padded_bytes)
            self._regions[name] = region
            self._end_bytes += padded_bytes

    def write(self, name: str, tensor: torch.Tensor) -> IOHandle:
        """Start writing `tensor` (contiguous CPU, the allocated dtype and numel) as `name`.

        Don't modify the tensor until the handle's wait() returns. A failed write (a full disk)
        raises SwapIOError from wait() and leaves the region FAILED: reading it raises too.
        """
        region = self._region_for_io(name, tensor)
        with self._cond:
            if region.state is RegionState.WRITING or region.num_reads_in_flight:
                raise AssertionError(f"write of swap tensor {name!r} while its state is {region.state.value} with "
                                     f"{region.num_reads_in_flight} read(s) in flight; wait their handles first")
            region.state, region.error = RegionState.WRITING, None
            self._num_in_flight += 1
        return self._submit("write", region, tensor, partial(self._write_done, region))

    def read(self, name: str, out: torch.Tensor) -> IOHandle:
        """Start reading tensor `name` into `out` (contiguous CPU, the allocated dtype and numel);
        `out` holds it once the handle's wait() returns."""
        region = self._region_for_io(name, out)
        with self._cond:
            if region.state is RegionState.FAILED:
                code = getattr(region.error, "errno", None) or errno.EIO
                raise SwapIOError(code, f"swap tensor {name!r} cannot be read: its last write failed "
                                        f"({region.error})") from region.error
            if region.state is not RegionState.VALID:
                raise AssertionError(f"read of swap tensor {name!r} in state {region.state.value}; write it and "
                                     "wait the write's handle first")
            region.num_reads_in_flight += 1
            self._num_in_flight += 1
        return self._submit("read", region, out, partial(self._read_done, region))

    def flush(self, drop_page_cache: bool = False) -> None:
        """fdatasync the swap file; with `drop_page_cache` also evict it from the page cache (so
        the next read measures the disk). Only needed for measurements: see aio's durability note."""
        self._check_open()
        os.fdatasync(self._file.fd)
        if drop_page_cache:
            os.posix_fadvise(self._file.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this store's I/O in flight, then delete its files and folders. Safe to repeat."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.wait_for(lambda: self._num_in_flight == 0)
        if self._owns_engine:
            self.engine.close()
        self._finalizer()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"swap store {self.directory} is closed")

    def _region(self, name: str) -> SwapRegion:
        if name not in self._regions:
            raise ValueError(f"swap tensor {name!r} was never allocated in {self.file_path}; call allocate first")
        return self._regions[name]

    def _region_for_io(self, name: str, tensor: torch.Tensor) -> SwapRegion:
        self._check_open()
        region = self._region(name)
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"swap tensor {name!r}: the buffer must be a contiguous CPU tensor, got device="
                             f"{tensor.device} contiguous={tensor.is_contiguous()}; pass an aligned_empty buffer")
        if tensor.dtype != region.dtype or tensor.numel() != region.numel:
            raise ValueError(f"swap tensor {name!r} was allocated as {region.numel} x {region.dtype} but the buffer "
                             f"is {tensor.numel()} x {tensor.dtype}; pass a buffer of the allocated size and dtype")
        return region

    def _context(self, region: SwapRegion) -> str:
        return (f"swap tensor {region.name!r} ({region.num_bytes} bytes at offset {region.file_offset} "
                f"of {self.file_path})")

    def _reserve(self, region: SwapRegion, padded_bytes: int) -> None:
        try:
            os.posix_fallocate(self._file.fd, region.file_offset, padded_bytes)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise SwapIOError.wrap(err, "allocation", f"{self._context(region)} under {self.key}") from err
            # The filesystem cannot reserve: grow the file sparsely, a full disk then shows at write time.
            os.ftruncate(self._file.fd, region.file_offset + padded_bytes)

    def _submit(self, kind: str, region: SwapRegion, tensor: torch.Tensor,
                on_done: Callable[[Optional[BaseException]], None]) -> IOHandle:
        submit = self.engine.submit_write if kind == "write" else self.engine.submit_read
        try:
            return submit(self._file, region.file_offset, tensor, context=self._context(region), on_done=on_done)
        except BaseException as err:
            on_done(err)  # undo the in-flight bookkeeping
            raise

    def _write_done(self, region: SwapRegion, error: Optional[BaseException]) -> None:
        with self._cond:
            region.state = RegionState.FAILED if error else RegionState.VALID
            region.error = error
            self._num_in_flight -= 1
            self._cond.notify_all()

    def _read_done(self, region: SwapRegion, error: Optional[BaseException]) -> None:
        with self._cond:
            region.num_reads_in_flight -= 1
            self._num_in_flight -= 1
            self._cond.notify_all()


def _log_mode_once(nvme_path: str, direct: bool, forced: bool) -> None:
    """Say once per folder and mode whether swap I/O bypasses the page cache."""
    if (nvme_path, direct) in _logged_modes:
        return
    _logged_modes.add((nvme_path, direct))
    why = "forced by direct_io=False" if forced else "the filesystem refused O_DIRECT"
    mode = "O_DIRECT (no page cache)" if direct else f"buffered I/O through the page cache ({why})"
    log_rank0("NVMe swap under %s uses %s", nvme_path, mode)


# ---------------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BandwidthResult:
    """Sequential swap bandwidth measured by `measure_swap_bandwidth`, in MB/s (10**6 bytes)."""

    size_bytes: int
    direct_io: bool
    write_MBps: float
    read_MBps: float


def measure_swap_bandwidth(nvme_path: str | os.PathLike, size_bytes: int = 256 << 20, *,
                           engine: Optional[AsyncFileIO] = None, direct_io: bool = True,
                           key: str = OPTIMIZER_NVME_PATH_KEY) -> BandwidthResult:
    """Write then read `size_bytes` (default 256 MiB) under `nvme_path` with one SwapStore and
    `engine` (default: aio defaults), and check the bytes came back. Write time includes the
    fdatasync; the page cache is dropped before the read, so buffered mode measures the disk too."""
    with SwapStore(nvme_path, key=key, expected_bytes=size_bytes, direct_io=direct_io, engine=engine) as store:
        buffer = aligned_empty(size_bytes, torch.uint8).fill_(0xA5)
        store.allocate("bandwidth-probe", size_bytes, torch.uint8)
        start = time.perf_counter()
        store.write("bandwidth-probe", buffer).wait()
        store.flush(drop_page_cache=True)
        write_seconds = time.perf_counter() - start
        buffer.zero_()
        start = time.perf_counter()
        store.read("bandwidth-probe", buffer).wait()
        read_seconds = time.perf_counter() - start
        if not bool((buffer == 0xA5).all()):
            raise AssertionError(f"bandwidth probe read back different bytes than it wrote in {store.file_path}")
        return BandwidthResult(size_bytes, store.direct_io, bandwidth_MBps(size_bytes, write_seconds),
                               bandwidth_MBps(size_bytes, read_seconds))
