"""The NVMe swap layer: engine round trips (O_DIRECT and buffered), the store's folders and cleanup,
preflight errors, full disks, the swap pipeline's ordering, and the bandwidth counters."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from zerodp.config.schema import AioConfig
from zerodp.offload import (
    ALIGN_BYTES, AsyncFileIO, IOCounters, PARAM_NVME_PATH_KEY, RegionState, SwapIOError, SwapStore,
    aligned_empty, bandwidth_MBps, check_host_memory, check_nvme_path, measure_swap_bandwidth,
    mem_available_bytes, probe_direct_io, remove_stale_swap_dirs, run_swap_pipeline,
)
from zerodp.offload import aio, nvme

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
ODD_NUMELS = [1, 1023, 12_345]  # never a whole number of 4 KiB blocks for any dtype above


@pytest.fixture
def engine():
    """Small blocks so that small tensors still make several requests and several lanes."""
    io_engine = AsyncFileIO(block_size=8192, queue_depth=4, num_threads=3)
    yield io_engine
    io_engine.close()


def _store(path: Path, engine: AsyncFileIO, direct_io: bool = True) -> SwapStore:
    if direct_io and not probe_direct_io(str(path)):
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")
    return SwapStore(path, engine=engine, direct_io=direct_io)


def _pattern(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    values = (torch.arange(numel) * 7 + seed) % 97
    return (values % 2).bool() if dtype is torch.bool else values.to(dtype)


def _unaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    buffer = aligned_empty(numel + 1, dtype)[1:]
    assert buffer.data_ptr() % ALIGN_BYTES
    return buffer


# --- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_odd_sizes(tmp_path, engine, direct_io, dtype):
    with _store(tmp_path, engine, direct_io) as store:
        assert store.direct_io is direct_io
        for numel in ODD_NUMELS:
            store.allocate(f"t{numel}", numel, dtype)
            # From an aligned buffer (in place) and an unaligned one (through the bounce buffer), into both.
            for seed, source in enumerate([aligned_empty(numel, dtype), _unaligned(numel, dtype)]):
                source.copy_(_pattern(numel, dtype, seed=numel + seed))
                store.write(f"t{numel}", source).wait()
                for out in (aligned_empty(numel, dtype), _unaligned(numel, dtype), torch.empty(numel, dtype=dtype)):
                    store.read(f"t{numel}", out.zero_()).wait()
                    assert torch.equal(out, source)


def test_a_swapped_in_slot_is_aligned_its_views_follow_and_its_storage_does_not_grow(tmp_path, engine):
    """offload/swap.py's [Note: aligned swap-ins]: O_DIRECT in place, views (stage 3's optimizer
    params) see the same values, and the alignment shift does not compound over cycles."""
    from zerodp.offload.swap import SwapSlot

    store = _store(tmp_path, engine)
    master = _pattern(12_345, torch.float32)
    expected = master.clone()
    views = [master[100:200], master[5000:]]
    slot = SwapSlot(store, "unit/master", master, views)
    slot.write().wait()
    slot.evict()
    sizes = set()
    for cycle in range(4):
        slot.read().wait()
        assert master.data_ptr() % ALIGN_BYTES == 0 and torch.equal(master, expected)
        assert torch.equal(views[0], expected[100:200]) and torch.equal(views[1], expected[5000:])
        views[1].add_(1)  # an optimizer step through a view reaches the master
        expected[5000:] += 1
        sizes.add(master.untyped_storage().size())
        slot.tensor = master  # as OptimizerSwapper._sync_slots does before every write-back
        slot.write().wait()
        slot.evict()
    assert len(sizes) == 1 and sizes.pop() <= master.numel() * 4 + ALIGN_BYTES
    store.close()


@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
def test_regions_are_aligned_and_padding_never_touches_a_neighbour(tmp_path, engine, direct_io):
    with _store(tmp_path, engine, direct_io) as store:
        store.allocate("a", 5, torch.uint8)
        store.allocate("b", 3, torch.float32)
        store.allocate("empty", 0, torch.float32)
        assert store.allocated_bytes == 2 * ALIGN_BYTES
        b = torch.tensor([1.5, -2.0, 3.25])
        store.write("b", b).wait()
        store.write("a", torch.full((5,), 9, dtype=torch.uint8)).wait()  # its padding ends where b starts
        store.write("empty", torch.empty(0)).wait()
        out = torch.empty(3)
        store.read("b", out).wait()
        assert torch.equal(out, b)
        assert store.state("empty") is RegionState.VALID


@pytest.mark.parametrize("refused_at", ["open", "first_io"])
def test_o_direct_refused_falls_back_to_buffered_and_logs_once(tmp_path, engine, monkeypatch, caplog, refused_at):
    real_open, real_pwrite = os.open, os.pwrite

    def open_without_direct(path, flags, *args):
        if refused_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def pwrite_without_direct(fd, data, offset):
        if refused_at == "first_io" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", open_without_direct)
    monkeypatch.setattr(os, "pwrite", pwrite_without_direct)
    caplog.set_level(logging.INFO, logger="zerodp")
    for _ in range(2):
        with SwapStore(tmp_path, engine=engine) as store:
            assert not store.direct_io
            store.allocate("x", 1001, torch.float32)
            store.write("x", _pattern(1001, torch.float32)).wait()
            out = torch.empty(1001)
            store.read("x", out).wait()
            assert torch.equal(out, _pattern(1001, torch.float32))
    mode_lines = [r.getMessage() for r in caplog.records if "NVMe swap under" in r.getMessage()]
    assert mode_lines == [f"NVMe swap under {tmp_path} uses buffered I/O through the page cache "
                          "(the filesystem refused O_DIRECT)"]
    assert not list(tmp_path.glob(".zerodp-odirect-probe-*"))


def test_concurrent_reads_and_writes_and_their_counters(tmp_path, engine):
    sources = [_pattern(5000 + 17 * i, torch.float32, seed=i) for i in range(8)]
    outs = [torch.empty_like(source) for source in sources]
    num_bytes = sum(source.numel() * 4 for source in sources)
    with _store(tmp_path, engine) as store:
        for i, source in enumerate(sources):
            store.allocate(f"t{i}", source.numel(), source.dtype)
            if i < 4:
                store.write(f"t{i}", source).wait()
        # Reads of t0..t3 in flight together with writes of t4..t7, then reads of t4..t7 together.
        mixed = [store.read(f"t{i}", outs[i]) if i < 4 else store.write(f"t{i}", sources[i]) for i in range(8)]
        for handle in mixed:
            handle.wait()
        for handle in [store.read(f"t{i}", outs[i]) for i in range(4, 8)]:
            handle.wait()
        assert all(torch.equal(out, source) for out, source in zip(outs, sources))
        stats = store.counters
    assert (stats.num_writes, stats.num_reads, stats.written_bytes, stats.read_bytes) == (8, 8, num_bytes, num_bytes)
    assert stats.write_seconds > 0 and stats.read_seconds > 0
    assert stats.read_MBps == pytest.approx(num_bytes / stats.read_seconds / 1e6)


def test_engine_config_and_queue_depth_bound_per_submit(tmp_path, monkeypatch):
    io_engine = AsyncFileIO(block_size=4096, queue_depth=2, num_threads=6)
    lock, in_flight, peak = threading.Lock(), [0], [0]
    second_in_flight = threading.Event()
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            if in_flight[0] >= 2:
                second_in_flight.set()
        # The first write waits until a second one is in flight (an engine that submits one at a
        # time leaves it waiting out the 60 s and the peak at 1): no reliance on timing.
        second_in_flight.wait(60)
        with lock:
            in_flight[0] -= 1
        return real_pwrite(fd, data, offset)

    with SwapStore(tmp_path, engine=io_engine, direct_io=False) as store:
        store.allocate("x", 16 * 4096, torch.uint8)
        monkeypatch.setattr(os, "pwrite", slow_pwrite)
        store.write("x", torch.ones(16 * 4096, dtype=torch.uint8)).wait()
    io_engine.close()
    assert peak[0] == 2
    with pytest.raises(ValueError, match=r"aio\.block_size=0 must be >= 1"):
        AsyncFileIO(block_size=0)
    with pytest.raises(ValueError, match=r"aio\.intra_op_parallelism=0 must be >= 1"):
        AsyncFileIO(num_threads=0)
    io_engine = AsyncFileIO.from_aio_config(AioConfig(block_size=1000, queue_depth=3, intra_op_parallelism=2))
    assert (io_engine.block_size, io_engine.queue_depth, io_engine.num_threads) == (4096, 3, 2)
    io_engine.close()


def test_misuse_is_reported(tmp_path, engine):
    with SwapStore(tmp_path, engine=engine) as store:
        store.allocate("x", 10, torch.float32)
        with pytest.raises(ValueError, match=r"'x' is already allocated"):
            store.allocate("x", 10, torch.float32)
        with pytest.raises(AssertionError, match=r"read of swap tensor 'x' in state allocated"):
            store.read("x", torch.empty(10))
        with pytest.raises(ValueError, match=r"allocated as 10 x torch.float32 but the buffer is 10 x torch.bfloat16"):
            store.write("x", torch.zeros(10, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"must be a contiguous CPU tensor"):
            store.write("x", torch.zeros(20)[::2])
        with pytest.raises(ValueError, match=r"'y' was never allocated"):
            store.write("y", torch.zeros(10))
    with pytest.raises(RuntimeError, match=r"is closed"):
        store.write("x", torch.zeros(10))


# --- folders and cleanup --------------------------------------------------------------------------
def test_each_store_gets_its_own_folder(tmp_path, engine):
    with SwapStore(tmp_path, engine=engine, rank=3) as first, SwapStore(tmp_path, engine=engine, rank=3) as second:
        assert first.run_directory != second.run_directory
        for store in (first, second):
            assert store.directory == store.run_directory / "rank3"
            assert store.file_path.parent == store.directory and store.file_path.exists()
            match = nvme._RUN_DIR_NAME.fullmatch(store.run_directory.name)
            assert match and match.group("host") == nvme._host_tag() and match.group("pid") == str(os.getpid())


def test_files_are_removed_on_close_exception_and_garbage_collection(tmp_path, engine):
    store = SwapStore(tmp_path, engine=engine)
    store.allocate("x", 100, torch.float32)
    store.write("x", torch.ones(100))  # not waited: close waits for it
    store.close()
    store.close()
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyError):
        with SwapStore(tmp_path, engine=engine) as store:
            store.allocate("x", 100, torch.float32)
            store.write("x", torch.ones(100)).wait()
            raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []

    store = SwapStore(tmp_path, engine=engine)
    assert store._finalizer.atexit  # the same finalizer runs at interpreter exit (next test)
    pid = os.fork()
    if pid == 0:  # a forked child (a DataLoader worker) collecting its copy must not delete our files
        store._finalizer()
        os._exit(0 if store.file_path.exists() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    del store
    assert list(tmp_path.iterdir()) == []


def test_files_are_removed_at_interpreter_exit(tmp_path):
    script = ("import sys, torch; from zerodp.offload import SwapStore\n"
              "store = SwapStore(sys.argv[1]); store.allocate('x', 10, torch.float32)\n"
              "store.write('x', torch.ones(10)).wait(); print(store.run_directory, flush=True)\n"
              "sys.modules['__main__'].keep = store\n")  # still referenced at exit: only atexit can clean
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leaves_files_that_the_next_run_removes(tmp_path, engine):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the killed run: no cleanup code can run
        try:
            store = SwapStore(tmp_path, engine=AsyncFileIO())
            os.write(write_end, str(store.run_directory).encode())
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(write_end)
    killed_dir = Path(os.read(read_end, 4096).decode())
    os.close(read_end)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert (killed_dir / "rank0" / "swap.bin").exists()
    other_host = tmp_path / "zerodp-swap-otherhost-1-0123456789ab"
    other_host.mkdir()
    (other_host / ".lock").touch()
    with SwapStore(tmp_path, engine=engine) as live:
        assert not killed_dir.exists()
        assert other_host.exists()  # another host's folder: its lock says nothing here
        assert remove_stale_swap_dirs(tmp_path) == []  # `live` holds its lock
        assert live.run_directory.exists()


# --- preflight ------------------------------------------------------------------------------------
def test_preflight_errors_name_the_key_path_and_fix(tmp_path):
    key = r"zero_optimization\.offload_param\.nvme_path"
    with pytest.raises(ValueError, match=rf"{key} is not set but the offload device is 'nvme'"):
        check_nvme_path(None, key=PARAM_NVME_PATH_KEY)
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"{key}='{missing}' does not exist; create it \(mkdir -p {missing}\)"):
        check_nvme_path(missing, key=PARAM_NVME_PATH_KEY)
    a_file = tmp_path / "file"
    a_file.touch()
    with pytest.raises(ValueError, match=rf"{key}='{a_file}' is not a folder"):
        check_nvme_path(a_file, key=PARAM_NVME_PATH_KEY)
    available = check_nvme_path(tmp_path, 1, key=PARAM_NVME_PATH_KEY)
    too_much = available + 2**40
    with pytest.raises(ValueError, match=rf"zero_optimization\.offload_optimizer\.nvme_path='{tmp_path}' has .* free "
                                         rf"but this run will write [\d.]+ TiB \({too_much} bytes\) there; free space"):
        SwapStore(tmp_path, expected_bytes=too_much)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing was written


@pytest.mark.parametrize("how", ["permissions", "refused_probe"])
def test_preflight_not_writable(tmp_path, monkeypatch, how):
    if how == "permissions" and os.geteuid() == 0:
        pytest.skip("running as root: permissions cannot make a folder unwritable (refused_probe covers the message)")
    real_open = os.open

    def refuse_probe(path, flags, *args):
        if ".zerodp-write-probe-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args)

    if how == "permissions":
        tmp_path.chmod(0o500)
    else:
        monkeypatch.setattr(os, "open", refuse_probe)
    try:
        with pytest.raises(ValueError, match=rf"offload_optimizer\.nvme_path='{tmp_path}' is not writable by "
                                             r"this process \(user id \d+: Permission denied\); fix the folder's"):
            SwapStore(tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_host_memory_check(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4000 kB\nMemFree:   10 kB\nMemAvailable:    1000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 1_024_000
    assert check_host_memory(1_024_000, what="x", fix="y", meminfo_path=str(meminfo)) == 1_024_000
    with pytest.raises(ValueError, match=r"offload_optimizer's 4 pinned buffers needs 1\.95 MiB \(2048000 bytes\) of "
                                         r"host memory but only 1000\.0 KiB \(1024000 bytes\) is available "
                                         r"\(MemAvailable in .*meminfo\); lower buffer_count"):
        check_host_memory(2_048_000, what="offload_optimizer's 4 pinned buffers", fix="lower buffer_count",
                          meminfo_path=str(meminfo))
    assert check_host_memory(1, what="x", fix="y", meminfo_path=str(tmp_path / "absent")) is None
    if Path("/proc/meminfo").exists():
        assert mem_available_bytes() > 0


# --- full disk ------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
def test_full_disk_raises_and_poisons_the_region(tmp_path, engine, monkeypatch, direct_io):
    with _store(tmp_path, engine, direct_io) as store:
        store.allocate("exp_avg.3", 50_000, torch.float32)
        store.write("exp_avg.3", torch.ones(50_000)).wait()
        real_pwrite, calls = os.pwrite, [0]

        def full_after_one(fd, data, offset):
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", full_after_one)
        handle = store.write("exp_avg.3", torch.full((50_000,), 2.0))
        message = (rf"write of swap tensor 'exp_avg\.3' \(200000 bytes at offset 0 of {store.file_path}\) failed: "
                   r".*No space left on device.*disk \(or quota\) under the swap folder is full")
        with pytest.raises(SwapIOError, match=message) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC
        assert store.state("exp_avg.3") is RegionState.FAILED
        with pytest.raises(SwapIOError, match=r"'exp_avg\.3' cannot be read: its last write failed"):
            store.read("exp_avg.3", torch.empty(50_000))
        assert calls[0] < 50_000 * 4 // 8192  # requests stop after the failure
        monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
        with pytest.raises(SwapIOError, match=r"0 bytes written \(disk full\?\)"):
            store.write("exp_avg.3", torch.ones(50_000)).wait()

        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", no_space)  # a full disk at allocation, before any step
        with pytest.raises(SwapIOError, match=r"allocation of swap tensor 'y' .* under zero_optimization\.offload_"
                                              r"optimizer\.nvme_path failed: .*No space left"):
            store.allocate("y", 10, torch.float32)


# --- the swap pipeline ----------------------------------------------------------------------------
class _FakeIO:
    """read/write callables whose handles finish on a thread after `gate(kind, i)` allows them."""

    def __init__(self, gate=lambda kind, chunk: None) -> None:
        self.events: list[tuple[str, int]] = []  # list.append is atomic: threads may record freely
        self.pool = ThreadPoolExecutor(4)
        self.gate = gate
        self.record = lambda event, chunk: self.events.append((event, chunk))
        self.read, self.write = (lambda chunk: self.io("read", chunk)), (lambda chunk: self.io("write", chunk))

    def io(self, kind: str, chunk: int):
        self.record(f"{kind}_issue", chunk)

        def run() -> None:
            time.sleep(0.001)
            self.gate(kind, chunk)
            self.record(f"{kind}_done", chunk)

        future = self.pool.submit(run)
        future.wait = future.result  # the driver only needs wait()
        return future

    def compute(self, chunk: int) -> None:
        self.record("compute_start", chunk)
        time.sleep(0.001)
        self.record("compute_end", chunk)

    def at(self, event: str, chunk: int) -> int:
        return self.events.index((event, chunk))


@pytest.mark.parametrize("buffer_count", [1, 2, 3, 4])
def test_pipeline_ordering_invariants(buffer_count):
    fake, num_chunks = _FakeIO(), 7
    run_swap_pipeline(num_chunks, fake.read, fake.compute, fake.write, buffer_count=buffer_count)
    for i in range(num_chunks):
        assert fake.at("read_done", i) < fake.at("compute_start", i)
        assert fake.at("compute_end", i) < fake.at("write_issue", i)
        assert ("write_done", i) in fake.events  # every write waited before returning
        if buffer_count > 1 and i + 1 < num_chunks:
            assert fake.at("read_issue", i + 1) < fake.at("compute_start", i)
        if i >= buffer_count:
            assert fake.at("write_done", i - buffer_count) < fake.at("read_issue", i)
    in_memory = peak = 0  # a chunk holds a buffer from its read's issue to its write's completion
    for event, _ in fake.events:
        in_memory += {"read_issue": 1, "write_done": -1}.get(event, 0)
        peak = max(peak, in_memory)
    assert peak <= buffer_count


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_pipeline_overlaps_read_next_and_write_previous_with_compute(buffer_count):
    started = {i: threading.Event() for i in range(6)}

    def gate(kind: str, chunk: int) -> None:
        # read(i+1) may only finish once compute(i) has started, and with 3 buffers write(i-1) only
        # once compute(i) has: a driver that waited for them first would time out here.
        if kind == "read" and chunk > 0 and not started[chunk - 1].wait(60):
            raise AssertionError(f"read({chunk}) was waited before compute({chunk - 1}) started")
        if kind == "write" and buffer_count >= 3 and chunk + 1 < 6 and not started[chunk + 1].wait(60):
            raise AssertionError(f"write({chunk}) was waited before compute({chunk + 1}) started")

    fake = _FakeIO(gate)

    def compute(chunk: int) -> None:
        started[chunk].set()
        fake.compute(chunk)

    run_swap_pipeline(6, fake.read, compute, fake.write, buffer_count=buffer_count)


def test_pipeline_with_a_swap_store_updates_every_chunk(tmp_path, engine):
    num_chunks, numel, buffer_count = 5, 3001, 3
    buffers = [aligned_empty(numel, torch.float32) for _ in range(buffer_count)]
    with _store(tmp_path, engine) as store:
        for i in range(num_chunks):
            store.allocate(f"chunk{i}", numel, torch.float32)
            store.write(f"chunk{i}", torch.full((numel,), float(i))).wait()

        def compute(i: int) -> None:
            buffers[i % buffer_count].add_(i + 1)

        for _ in range(2):
            run_swap_pipeline(num_chunks, lambda i: store.read(f"chunk{i}", buffers[i % buffer_count]), compute,
                              lambda i: store.write(f"chunk{i}", buffers[i % buffer_count]), buffer_count=buffer_count)
        for i in range(num_chunks):
            out = torch.empty(numel)
            store.read(f"chunk{i}", out).wait()
            assert torch.equal(out, torch.full((numel,), float(i + 2 * (i + 1))))


def test_pipeline_error_waits_for_io_in_flight_then_propagates():
    fake = _FakeIO()

    def compute(chunk: int) -> None:
        if chunk == 2:
            raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        run_swap_pipeline(5, fake.read, compute, fake.write, buffer_count=3)
    issued = {(e.split("_")[0], i) for e, i in fake.events if e.endswith("_issue")}
    done = {(e.split("_")[0], i) for e, i in fake.events if e.endswith("_done")}
    assert issued == done == {("read", 0), ("read", 1), ("read", 2), ("read", 3), ("write", 0), ("write", 1)}
    def fail_write_2(kind: str, chunk: int) -> None:
        if (kind, chunk) == ("write", 2):
            raise OSError(errno.EIO, "write 2 failed")

    fake = _FakeIO(fail_write_2)
    with pytest.raises(OSError, match="write 2 failed"):  # a write failing in the final drain
        run_swap_pipeline(4, fake.read, fake.compute, fake.write, buffer_count=4)
    assert {i for e, i in fake.events if e == "write_done"} == {0, 1, 3}  # the others were still waited
    with pytest.raises(ValueError, match=r"buffer_count=0 must be >= 1"):
        run_swap_pipeline(1, fake.read, fake.compute, fake.write, buffer_count=0)


# --- bandwidth ------------------------------------------------------------------------------------
def test_counters_add_bytes_and_busy_time_not_summed_durations(monkeypatch):
    now = [0.0]
    counters = IOCounters()
    monkeypatch.setattr(aio.time, "perf_counter", lambda: now[0])
    for now[0], kind, change in [(0.0, "read", +1), (1.0, "read", +1), (2.0, "read", 100), (5.0, "read", 300),
                                 (9.0, "read", +1), (10.0, "read", 0)]:
        counters.begin(kind) if change == +1 else counters.end(kind, change)
    # Two overlapping reads busy 0..5 (5 s, not 2 + 4 = 6 s), then one failed read 9..10 moving 0 bytes.
    stats = counters.snapshot()
    assert (stats.read_bytes, stats.num_reads, stats.read_seconds) == (400, 3, 6.0)
    assert stats.read_MBps == 400 / 6 / 1e6 and stats.write_MBps == 0.0
    assert bandwidth_MBps(10**6, 0.5) == 2.0 and bandwidth_MBps(10, 0) == 0.0


@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
def test_measure_swap_bandwidth(tmp_path, engine, direct_io):
    result = measure_swap_bandwidth(tmp_path, 4 << 20, engine=engine, direct_io=direct_io)
    assert result.size_bytes == 4 << 20
    assert result.direct_io == (direct_io and probe_direct_io(str(tmp_path)))
    assert result.write_MBps > 0 and result.read_MBps > 0
    assert list(tmp_path.iterdir()) == []
