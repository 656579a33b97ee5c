"""Offload to NVMe: the thread-pool file I/O engine and swap pipeline (`aio`), and the swap store,
its preflight checks and the bandwidth probe on top of them (`nvme`). (`cpu`: host-memory offload.)

The strategies keep their optimizer state (and stage-3 parameter shards) in a `SwapStore` when the
offload device is "nvme"; `run_swap_pipeline` overlaps reading the next sub-group, stepping this one
and writing the previous one (design.md §7).
"""

from zerodp.offload.aio import (
    ALIGN_BYTES,
    AsyncFileIO,
    IOCounters,
    IOHandle,
    IOStats,
    SwapFile,
    SwapIOError,
    aligned_empty,
    bandwidth_MBps,
    open_swap_file,
    probe_direct_io,
    run_swap_pipeline,
)
from zerodp.offload.nvme import (
    OPTIMIZER_NVME_PATH_KEY,
    PARAM_NVME_PATH_KEY,
    BandwidthResult,
    RegionState,
    SwapStore,
    check_host_memory,
    check_nvme_path,
    disk_free_bytes,
    measure_swap_bandwidth,
    mem_available_bytes,
    remove_stale_swap_dirs,
)

__all__ = [
    "ALIGN_BYTES",
    "AsyncFileIO",
    "BandwidthResult",
    "IOCounters",
    "IOHandle",
    "IOStats",
    "OPTIMIZER_NVME_PATH_KEY",
    "PARAM_NVME_PATH_KEY",
    "RegionState",
    "SwapFile",
    "SwapIOError",
    "SwapStore",
    "aligned_empty",
    "bandwidth_MBps",
    "check_host_memory",
    "check_nvme_path",
    "disk_free_bytes",
    "measure_swap_bandwidth",
    "mem_available_bytes",
    "open_swap_file",
    "probe_direct_io",
    "remove_stale_swap_dirs",
    "run_swap_pipeline",
]
