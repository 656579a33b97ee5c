"""Thread-pool positional file I/O: the engine under NVMe offload (DeepSpeed's `aio` section).

A read or write of one tensor is split into `block_size` requests at file offsets; a pool of
`intra_op_parallelism` threads per direction runs them with os.pwrite / os.preadv straight into
the tensor's memory, at most `queue_depth` requests of one submit at a time. The caller gets an
`IOHandle` and waits on it later, so compute overlaps with the I/O:

    engine = AsyncFileIO(block_size=1 << 20, queue_depth=8, num_threads=4)
    swap_file = open_swap_file(path, direct=probe_direct_io(folder))
    handle = engine.submit_write(swap_file, 0, tensor, context="tensor 'm0'")
    ...compute...
    handle.wait()

`run_swap_pipeline` overlaps such handles with compute: read(i+1) / compute(i) / write(i-1).

[Note: why threads, not libaio]
os.pwrite and os.preadv release the GIL for the whole system call, so N threads keep N requests in
the kernel at once, which is what libaio's queue depth buys DeepSpeed, with no compiled extension.
`aio.single_submit` and `aio.overlap_events` tune how libaio batches submissions and reaps
completions; a thread pool has neither step, so they are accepted and have no effect here.

[Note: read and write pools]
Reads and writes have `intra_op_parallelism` threads each. With one FIFO pool, a submission's
lanes fill every thread, so the swap pipeline's read of chunk i+1 waited behind the write of
chunk i-1 and the disk saw one direction at a time; measured on this machine's disk (sustained,
1 GiB tensors, 4 threads): reads 1.23 GB/s, writes 2.06 GB/s, both at once 1.80 GB/s together,
where the same bytes one direction after the other would move at 1.54 GB/s (computed from the two).

[Note: O_DIRECT]
O_DIRECT moves bytes between the device and the buffer with no page-cache copy and without
evicting useful pages (offloaded state is larger than RAM by design, caching it helps nobody). The
kernel then wants the buffer address, the file offset and the length to be multiples of the
device's logical block size; ALIGN_BYTES = 4096 covers every common device. So the engine
- rounds `block_size` up to a multiple of ALIGN_BYTES, so every request starts aligned;
- does the I/O in place when the tensor's data is aligned (`aligned_empty` allocates such
  tensors), else through a per-thread aligned bounce buffer (one extra copy per block);
- pads a tensor's last partial block: a write pads it with zeros (the store rounds every region up
  to ALIGN_BYTES, so padding never touches a neighbour); a read fetches the whole block through the
  bounce buffer and copies only the tensor's bytes (at most 4095 bytes copied per tensor).
Some filesystems refuse O_DIRECT (tmpfs before Linux 6.6, some FUSE and network filesystems) with
EINVAL at open or at the first I/O. `probe_direct_io` asks once per folder with a 4 KiB probe
file before any data is written, so the mode never changes under running I/O.

[Note: buffered mode and durability]
Without O_DIRECT the same requests go through the page cache, with no fsync: swap files are
scratch that no later run reads (a crashed run resumes from a checkpoint), and a read after a write
in the same process sees the written bytes through the page cache. The store reserves each region
with posix_fallocate when it is allocated, so on local filesystems a full disk shows up at
allocation, before training starts; a write that still fails (ENOSPC on a filesystem that cannot
reserve) raises `SwapIOError`, it never leaves a silently short region.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Protocol

import torch

from zerodp.log import logger
from zerodp.timers import waiting

ALIGN_BYTES = 4096  # O_DIRECT alignment of buffers, offsets and lengths (see [Note: O_DIRECT])
_DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP}  # how a filesystem says "no O_DIRECT here"

IOKind = Literal["read", "write"]
DoneCallback = Callable[[Optional[BaseException]], None]


def round_up(num: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `num`."""
    return -(-num // multiple) * multiple


def aligned_empty(numel: int, dtype: torch.dtype, *, align_bytes: int = ALIGN_BYTES,
                  pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts at a multiple of `align_bytes` (4096).

    O_DIRECT reads and writes go straight into such a tensor, with no bounce copy. The tensor is a
    view into a slightly larger uint8 allocation. `pin_memory` (default False) pins it for fast
    host-device copies when CUDA is available; without CUDA there is nothing to pin for and it is
    ignored.
    """
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    pin = pin_memory and torch.cuda.is_available()
    raw = torch.empty(num_bytes + align_bytes, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % align_bytes
    return raw[skip:skip + num_bytes].view(dtype)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's own memory (no copy, any dtype)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"swap I/O needs a contiguous CPU tensor, got device={tensor.device} "
            f"contiguous={tensor.is_contiguous()}; pass tensor.contiguous().cpu() (or an aligned_empty buffer)"
        )
    # Through ctypes, not .numpy(): exporting to numpy marks the storage non-resizable for good, and
    # NVMe offload frees swapped-out tensors by resizing their storage to 0 (offload/swap.py). The
    # caller keeps the tensor alive until the I/O is waited (IOHandle).
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_char * num_bytes).from_address(tensor.data_ptr())
    raw.keepalive = tensor  # the view holds `raw`, `raw` holds the tensor: its memory outlives the I/O
    return memoryview(raw).cast("B")


@dataclass(frozen=True)
class SwapFile:
    """An open file the engine reads and writes: descriptor, path (for messages), O_DIRECT or not."""

    fd: int
    path: str
    direct: bool


def open_swap_file(path: str, *, direct: bool) -> SwapFile:
    """Create `path` (it must not exist) for reading and writing, with O_DIRECT if `direct`."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    return SwapFile(os.open(path, flags, 0o600), path, direct)


def probe_direct_io(directory: str) -> bool:
    """Whether the filesystem of `directory` accepts O_DIRECT: open, write and read a 4 KiB file.

    False when the open or the first I/O fails with EINVAL/EOPNOTSUPP (the filesystem refuses);
    any other error (permission, full disk) is raised. The probe file is always removed.
    """
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".zerodp-odirect-probe-{uuid.uuid4().hex}")
    try:
        try:
            swap_file = open_swap_file(path, direct=True)
        except OSError as err:
            if err.errno in _DIRECT_REFUSED:
                return False
            raise
        try:
            block = byte_view(aligned_empty(ALIGN_BYTES, torch.uint8).fill_(0x5A))
            _transfer("write", swap_file.fd, block, 0, direct=True)
            _transfer("read", swap_file.fd, block, 0, direct=True)
            return True
        except OSError as err:
            if err.errno in _DIRECT_REFUSED:
                return False
            raise
        finally:
            os.close(swap_file.fd)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SwapIOError(OSError):
    """A swap-file read or write failed. `errno` is the system's; the message names the file, the
    tensor and what to do. The region written is incomplete: the caller must treat it as fatal."""

    @classmethod
    def wrap(cls, err: OSError, kind: IOKind, context: str) -> "SwapIOError":
        """A SwapIOError for `err`, raised while doing `kind` of `context` (tensor, offset, path)."""
        code = err.errno if err.errno is not None else errno.EIO
        hint = ""
        if code in (errno.ENOSPC, errno.EDQUOT):
            hint = (" The disk (or quota) under the swap folder is full: free space there or point "
                    "nvme_path at a larger disk; this region is now incomplete and must not be read.")
        wrapped = cls(code, f"{kind} of {context} failed: {err}.{hint}")
        wrapped.__cause__ = err
        return wrapped


def _transfer(kind: IOKind, fd: int, buf: memoryview, file_offset: int, *, direct: bool) -> None:
    """Move all of `buf` to (write) or from (read) the file at `file_offset`, finishing short transfers."""
    done = 0
    while done < len(buf):
        if kind == "write":
            num = os.pwrite(fd, buf[done:], file_offset + done)
        else:
            num = os.preadv(fd, [buf[done:]], file_offset + done)
        if num <= 0:
            what = "end of file" if kind == "read" else "0 bytes written (disk full?)"
            raise OSError(errno.EIO, f"{what} at offset {file_offset + done}")
        done += num
        if direct and done < len(buf) and num % ALIGN_BYTES:
            # The rest would start unaligned and O_DIRECT would refuse it with a misleading EINVAL.
            raise OSError(errno.EIO, f"short O_DIRECT {kind} of {num} bytes at offset {file_offset + done - num} "
                                     "(disk full?)")


@dataclass(frozen=True)
class IOStats:
    """A snapshot of an engine's I/O counters. `*_seconds` is wall time with at least one op of
    that kind in flight, so bytes / seconds is the bandwidth achieved while it was busy."""

    read_bytes: int
    written_bytes: int
    read_seconds: float
    write_seconds: float
    num_reads: int
    num_writes: int

    @property
    def read_MBps(self) -> float:
        """Achieved read bandwidth in MB/s (10**6 bytes), 0 before any read."""
        return bandwidth_MBps(self.read_bytes, self.read_seconds)

    @property
    def write_MBps(self) -> float:
        """Achieved write bandwidth in MB/s (10**6 bytes), 0 before any write."""
        return bandwidth_MBps(self.written_bytes, self.write_seconds)


def bandwidth_MBps(num_bytes: int, seconds: float) -> float:
    """num_bytes / seconds in MB/s (10**6 bytes per second); 0 when no time was spent."""
    return num_bytes / seconds / 1e6 if seconds > 0 else 0.0


class IOCounters:
    """Bytes moved and busy time, per direction, counted by the engine from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = {"read": 0, "write": 0}  # ops submitted and not finished, per kind
        self.reset()

    def reset(self) -> None:
        """Zero every counter (ops in flight keep being timed from now)."""
        with self._lock:
            self._bytes = {"read": 0, "write": 0}
            self._ops = {"read": 0, "write": 0}
            self._busy_seconds = {"read": 0.0, "write": 0.0}
            self._busy_since = {kind: time.perf_counter() for kind in ("read", "write")}

    def begin(self, kind: IOKind) -> None:
        """An op of `kind` was submitted."""
        with self._lock:
            if self._in_flight[kind] == 0:
                self._busy_since[kind] = time.perf_counter()
            self._in_flight[kind] += 1

    def end(self, kind: IOKind, num_bytes: int) -> None:
        """An op of `kind` finished, having moved `num_bytes` (0 if it failed)."""
        with self._lock:
            self._in_flight[kind] -= 1
            self._bytes[kind] += num_bytes
            self._ops[kind] += 1
            if self._in_flight[kind] == 0:
                self._busy_seconds[kind] += time.perf_counter() - self._busy_since[kind]

    def snapshot(self) -> IOStats:
        """The counters now; ops still in flight count their busy time so far."""
        with self._lock:
            now = time.perf_counter()
            busy = {kind: self._busy_seconds[kind] + (now - self._busy_since[kind] if self._in_flight[kind] else 0.0)
                    for kind in ("read", "write")}
            return IOStats(self._bytes["read"], self._bytes["write"], busy["read"], busy["write"],
                           self._ops["read"], self._ops["write"])


@dataclass
class _Submission:
    """One tensor's read or write, shared by the lanes that run its requests."""

    kind: IOKind
    swap_file: SwapFile
    file_offset: int
    view: memoryview  # the tensor's bytes; holding it keeps the tensor's memory alive
    address: int  # data_ptr of the tensor, to know which requests are aligned
    num_requests: int
    context: str
    on_done: Optional[DoneCallback]
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_request: int = 0
    lanes_left: int = 0
    error: Optional[BaseException] = None


class IOHandle:
    """A submitted read or write. `wait()` blocks until every request of it has finished."""

    def __init__(self, lanes: list[Future], submission: _Submission) -> None:
        self._lanes = lanes
        self._submission = submission

    def done(self) -> bool:
        """Whether every request has finished (successfully or not)."""
        return all(lane.done() for lane in self._lanes)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done (at most `timeout` seconds, default forever); raise the op's error.

        Returns only when no request still touches the tensor, even when one failed, so the
        caller may reuse or free the buffer after this call however it ends.
        """
        with waiting("nvme"):  # the step breakdown's disk waits (zerodp/timers.py)
            _, not_done = wait_futures(self._lanes, timeout)
        if not_done:
            raise TimeoutError(f"swap I/O still running after {timeout} s: {self._submission.context}")
        for lane in self._lanes:
            lane.result()  # a failing on_done callback surfaces here
        if self._submission.error is not None:
            raise self._submission.error


class AsyncFileIO:
    """The I/O engine: `num_threads` workers (aio.intra_op_parallelism) doing positional reads and
    writes of `block_size`-byte requests (aio.block_size, rounded up to 4096), at most `queue_depth`
    (aio.queue_depth) requests of one submit in flight. Defaults are DeepSpeed's `aio` defaults."""

    def __init__(self, block_size: int = 1_048_576, queue_depth: int = 8, num_threads: int = 1) -> None:
        for key, value in (("block_size", block_size), ("queue_depth", queue_depth),
                           ("intra_op_parallelism", num_threads)):
            if value < 1:
                raise ValueError(f"aio.{key}={value} must be >= 1; set aio.{key} to a positive integer")
        self.block_size = round_up(block_size, ALIGN_BYTES)  # see [Note: O_DIRECT]
        self.queue_depth = queue_depth
        self.num_threads = num_threads
        self.counters = IOCounters()
        # one pool per direction: a read (which the step waits for) never queues behind a write
        # (which only frees a buffer), and the disk gets both at once (see [Note: read and write pools])
        self._pools = {kind: ThreadPoolExecutor(num_threads, thread_name_prefix=f"zerodp-aio-{kind}")
                       for kind in ("read", "write")}
        self._local = threading.local()  # each worker's aligned bounce buffer, made on first use

    @classmethod
    def from_aio_config(cls, aio: Any) -> "AsyncFileIO":
        """An engine configured by an `aio` config section (zerodp.config.schema.AioConfig)."""
        return cls(aio.block_size, aio.queue_depth, aio.intra_op_parallelism)

    def submit_write(self, swap_file: SwapFile, file_offset: int, tensor: torch.Tensor, *,
                     context: str = "", on_done: Optional[DoneCallback] = None) -> IOHandle:
        """Start writing `tensor`'s bytes to `swap_file` at `file_offset`; don't modify the tensor
        until the handle is done. `on_done(error_or_None)` runs in a worker once all requests end;
        `context` names the tensor in error messages."""
        return self._submit("write", swap_file, file_offset, tensor, context, on_done)

    def submit_read(self, swap_file: SwapFile, file_offset: int, tensor: torch.Tensor, *,
                    context: str = "", on_done: Optional[DoneCallback] = None) -> IOHandle:
        """Start reading `tensor`'s bytes from `swap_file` at `file_offset` into the tensor (see
        submit_write for `context` and `on_done`); its contents are undefined until the handle is done."""
        return self._submit("read", swap_file, file_offset, tensor, context, on_done)

    def close(self) -> None:
        """Finish queued requests and stop the worker threads."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    def _submit(self, kind: IOKind, swap_file: SwapFile, file_offset: int, tensor: torch.Tensor,
                context: str, on_done: Optional[DoneCallback]) -> IOHandle:
        if swap_file.direct and file_offset % ALIGN_BYTES:
            raise AssertionError(f"O_DIRECT {kind} at offset {file_offset}, not a multiple of {ALIGN_BYTES}: {context}")
        view = byte_view(tensor)
        num_requests = -(-len(view) // self.block_size)
        submission = _Submission(kind, swap_file, file_offset, view, tensor.data_ptr(), num_requests,
                                 context or swap_file.path, on_done)
        if num_requests == 0:
            if on_done is not None:
                on_done(None)
            return IOHandle([], submission)
        submission.lanes_left = min(self.queue_depth, num_requests)
        self.counters.begin(kind)
        lanes = [self._pools[kind].submit(self._run_lane, submission) for _ in range(submission.lanes_left)]
        return IOHandle(lanes, submission)

    def _run_lane(self, sub: _Submission) -> None:
        """Take the submission's next request until none is left or one failed. Never raises."""
        while True:
            with sub.lock:
                if sub.error is not None or sub.next_request == sub.num_requests:
                    break
                index = sub.next_request
                sub.next_request += 1
            try:
                self._run_request(sub, index)
            except Exception as err:  # recorded, then raised by IOHandle.wait in the caller's thread
                with sub.lock:
                    if sub.error is None:
                        sub.error = SwapIOError.wrap(err, sub.kind, sub.context) if isinstance(err, OSError) else err
        with sub.lock:
            sub.lanes_left -= 1
            last_lane = sub.lanes_left == 0
        if last_lane:
            self.counters.end(sub.kind, 0 if sub.error else len(sub.view))
            if sub.on_done is not None:
                sub.on_done(sub.error)

    def _run_request(self, sub: _Submission, index: int) -> None:
        """Request `index`: bytes [index*block, (index+1)*block) of the tensor, in place where aligned."""
        start = index * self.block_size
        segment = sub.view[start:start + self.block_size]
        file_offset = sub.file_offset + start
        if not sub.swap_file.direct:
            _transfer(sub.kind, sub.swap_file.fd, segment, file_offset, direct=False)
            return
        in_place = 0
        if (sub.address + start) % ALIGN_BYTES == 0:
            in_place = len(segment) // ALIGN_BYTES * ALIGN_BYTES
            if in_place:
                _transfer(sub.kind, sub.swap_file.fd, segment[:in_place], file_offset, direct=True)
        if in_place < len(segment):
            self._bounced(sub.kind, sub.swap_file.fd, sub.address + start + in_place, len(segment) - in_place,
                          file_offset + in_place)

    def _bounced(self, kind: IOKind, fd: int, address: int, num_bytes: int, file_offset: int) -> None:
        """O_DIRECT I/O of `num_bytes` at memory `address` (unaligned, or a partial block) through this
        thread's aligned buffer. The copies are ctypes.memmove calls, which release the GIL, so the
        other I/O threads and the training thread keep running during them."""
        if getattr(self._local, "bounce", None) is None:
            tensor = aligned_empty(self.block_size, torch.uint8)
            self._local.bounce = (tensor, byte_view(tensor), tensor.data_ptr())
        _, view, bounce_address = self._local.bounce
        padded = round_up(num_bytes, ALIGN_BYTES)
        if kind == "write":
            ctypes.memmove(bounce_address, address, num_bytes)
            ctypes.memset(bounce_address + num_bytes, 0, padded - num_bytes)  # never another tensor's bytes
            _transfer(kind, fd, view[:padded], file_offset, direct=True)
        else:
            _transfer(kind, fd, view[:padded], file_offset, direct=True)
            ctypes.memmove(address, bounce_address, num_bytes)


# ---------------------------------------------------------------------------------------------
# The swap pipeline: overlapping handles with compute
# ---------------------------------------------------------------------------------------------


class Waitable(Protocol):
    """Anything with a blocking wait() that raises the operation's error: an IOHandle, say."""

    def wait(self) -> object: ...


def run_swap_pipeline(num_chunks: int, read: Callable[[int], Optional[Waitable]], compute: Callable[[int], None],
                      write: Callable[[int], Optional[Waitable]], *, buffer_count: int) -> None:
    """Run compute(i) for i in 0..num_chunks-1 over swapped chunks, overlapping read(i+1), compute(i)
    and write(i-1). Chunk i uses buffer i % buffer_count (the callables' business); read and write
    return a handle with wait() (or None when there is nothing to wait for).

    Guarantees: compute(i) starts after read(i)'s handle is waited; read(j) is issued only after the
    write of the chunk that last used its buffer (j - buffer_count) has completed, so at most
    buffer_count chunks are in memory; every write is waited before returning; on an error every
    handle in flight is waited before it propagates (no thread still touches a buffer).
    buffer_count >= 3 overlaps all three; 2 waits write(i-1) before read(i+1); 1 serialises.
    """
    if buffer_count < 1:
        raise ValueError(f"buffer_count={buffer_count} must be >= 1 to swap through buffers; set the offload "
                         "section's buffer_count to 3 or more for full overlap")
    reads: dict[int, Optional[Waitable]] = {}  # chunk -> its read in flight
    writes: dict[int, Optional[Waitable]] = {}  # buffer -> the write of the chunk last in it
    try:
        for i in range(num_chunks):
            if i not in reads:
                _issue_read(i, read, reads, writes, buffer_count)
            if buffer_count > 1 and i + 1 < num_chunks:
                _issue_read(i + 1, read, reads, writes, buffer_count)
            _wait(reads.pop(i))
            compute(i)
            writes[i % buffer_count] = write(i)
        while writes:
            _wait(writes.pop(next(iter(writes))))  # in issue order
    except BaseException:
        _wait_quietly([*reads.values(), *writes.values()])
        raise


def _issue_read(chunk: int, read: Callable[[int], Optional[Waitable]], reads: dict, writes: dict,
                buffer_count: int) -> None:
    slot = chunk % buffer_count
    if slot in writes:
        _wait(writes.pop(slot))  # the buffer is about to be overwritten: its last write must be on disk
    reads[chunk] = read(chunk)


def _wait(handle: Optional[Waitable]) -> None:
    if handle is not None:
        handle.wait()


def _wait_quietly(handles: list[Optional[Waitable]]) -> None:
    """Wait every handle, logging (not raising) their errors: an earlier error is propagating."""
    for handle in handles:
        try:
            _wait(handle)
        except Exception as err:
            logger.warning("swap I/O failed while unwinding an earlier error: %s", err)
