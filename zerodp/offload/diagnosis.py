"""What an offloaded step waits on, and which setting would help: `engine.step_report()["offload"]`.

[Note: the offload diagnosis]
At start-up an engine that offloads measures what its step will be limited by (`probe_offload`):
- the host-device link: a 64 MiB copy each way from pinned and from pageable host memory, timed
  with CUDA events (on CUDA only; on a CPU device nothing crosses a link);
- each NVMe swap store's disk: a write (with its fdatasync) and a read back, with the page cache
  dropped between, of as many bytes as the store moves in a step (4-64 MiB), through the run's own
  `aio` settings and O_DIRECT mode (zerodp.offload.nvme.measure_swap_bandwidth). The ranks of one
  machine probe at once, so each measures its share of a shared disk, as in the step;
- the host optimizer: two steps of the engine's optimizer class with its hyperparameters on a
  tensor of up to 2M elements; the second step's elements per second.
`ZERODP_OFFLOAD_PROBE=0` skips them (the report then gives what it measured, without the floors).

Every step the report then holds what the step moved (host-device copy bytes, each store's disk
bytes) and the **floor** each resource puts under the step: bytes / probed bandwidth, the least
time the link or the disk needs for that traffic whatever the settings. `advice` compares the
waits with those floors, with the CPU step and with the swap layout (`chunks` of at most
`largest_chunk` elements, `buffer_count` of them in memory):
- swap pipeline: the step's NVMe time is read(i+1) / CPU step(i) / write(i-1) over n chunks, at
  best max(F, C) + min(F, C) / n (F the disk floor, C the CPU step: one chunk's worth of the smaller
  cannot overlap). One chunk (sub_group_size at least the owned shard) or buffer_count 1 serialise
  them: F + C. When min(F, C) is at least a tenth of the step, more chunks / buffer_count 3 save up
  to the difference.
- chunk overhead: the CPU step beyond the probe's time for the same elements is taken for a fixed
  cost per chunk (Python, thread hand-offs, one optimizer call per chunk; it also holds the step's
  other work, clipping and the copy of the updated shard, which fewer chunks do not save: so the
  advice never asks for fewer than 4 chunks, below which the pipeline stops overlapping, and only
  when it at least halves their number); when it is a tenth of the step, a larger sub_group_size.
- otherwise, when the disk floor is half the step or more, the disk sets the pace: no setting goes
  below the floor (more accumulation, a faster disk, or CPU offload do).
- pinned memory: pageable copies against the probe's pinned bandwidth; the link floor likewise.
Checked on this machine's disk by bench/offload_advice.py (docs/offload.md, "What the step waits
on"): the disk floor was within 25% of the measured disk waits, and following the advice from any
sub_group_size led to the one that measured fastest. On CUDA the copies' waits are host times (zerodp/timers.py): a blocking copy also waits for
the kernels queued before it, so on a GPU the copy wait is an upper bound and the floor the figure
to trust.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zerodp.log import logger
from zerodp.offload.aio import AsyncFileIO
from zerodp.offload.nvme import BandwidthResult, measure_swap_bandwidth
from zerodp.offload.swap import CHUNK_ALIGN_NUMEL

_COPY_PROBE_BYTES = 64 << 20
_DISK_PROBE_BYTES = (4 << 20, 64 << 20)  # at least, at most
_OPTIMIZER_PROBE_NUMEL = 2 << 20
_NOTABLE = 0.1  # a share of the step worth a piece of advice
_PIPELINED_CHUNKS = 4  # fewer chunks than this leave the disk and the CPU step little to overlap
_MiB = 1 << 20


@dataclass(frozen=True)
class OffloadProbes:
    """What `probe_offload` measured (None / empty where it did not run)."""

    copy_GBps: dict[str, float] | None = None  # h2d/d2h x pinned/pageable
    disk: dict[str, BandwidthResult] = field(default_factory=dict)  # per swap store
    optimizer_elements_per_s: float | None = None
    skipped: bool = False

    def as_dict(self) -> dict:
        return {"copy_GBps": self.copy_GBps, "optimizer_elements_per_s": self.optimizer_elements_per_s,
                "disk": {name: {"read_MBps": r.read_MBps, "write_MBps": r.write_MBps, "direct_io": r.direct_io,
                                "probe_bytes": r.size_bytes} for name, r in self.disk.items()},
                "skipped": self.skipped}


def probe_offload(device: torch.device, optimizer: torch.optim.Optimizer | None, host_optimizer: bool,
                  stores: dict, swap_bytes: dict[str, int], aio: Any) -> OffloadProbes:
    """[Note: the offload diagnosis]'s start-up probes. `stores`: the strategy's swap stores by name;
    `swap_bytes`: the bytes each moves per step (its probe's size, within 4-64 MiB)."""
    if os.environ.get("ZERODP_OFFLOAD_PROBE", "1") == "0":
        return OffloadProbes(skipped=True)
    start = time.perf_counter()
    disk = {}
    for name, store in stores.items():
        size = min(max(swap_bytes.get(name, 0), _DISK_PROBE_BYTES[0]), _DISK_PROBE_BYTES[1]) // _MiB * _MiB
        engine = AsyncFileIO.from_aio_config(aio)
        try:
            disk[name] = measure_swap_bandwidth(store.run_directory.parent, size, engine=engine,
                                                direct_io=store.direct_io, key=store.key)
        finally:
            engine.close()
    probes = OffloadProbes(copy_GBps=probe_copy_GBps(device), disk=disk,
                           optimizer_elements_per_s=probe_optimizer_rate(optimizer) if host_optimizer else None)
    logger.debug("offload probes (%.2f s): %s", time.perf_counter() - start, probes.as_dict())
    return probes


def probe_copy_GBps(device: torch.device, num_bytes: int = _COPY_PROBE_BYTES) -> dict[str, float] | None:
    """Host-device copy bandwidth in GB/s (10**9 bytes), each direction, from pinned and pageable
    host memory, timed with CUDA events after one warm-up copy; None off CUDA."""
    if device.type != "cuda":
        return None
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    out = {}
    for pinned in (True, False):
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        for direction, (dst, src) in (("h2d", (on_device, host)), ("d2h", (host, on_device))):
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=pinned)
            end.record()
            end.synchronize()
            out[f"{direction}_{'pinned' if pinned else 'pageable'}"] = num_bytes / (begin.elapsed_time(end) / 1e3) / 1e9
    return out


def probe_optimizer_rate(optimizer: torch.optim.Optimizer | None, numel: int = _OPTIMIZER_PROBE_NUMEL) -> float | None:
    """Elements per second of `optimizer`'s class and first group's hyperparameters on a host
    tensor of `numel` elements (the second of two steps: the first creates the state); None when
    the class cannot be rebuilt from its hyperparameters."""
    if optimizer is None or not optimizer.param_groups or not optimizer.param_groups[0]["params"]:
        return None
    group = optimizer.param_groups[0]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in group.items() if k != "params" and k in accepted}
    probe = torch.zeros(numel, dtype=group["params"][0].dtype, requires_grad=True)
    probe.grad = torch.full_like(probe, 1e-3)
    try:
        stepper = type(optimizer)([probe], **kwargs)
        stepper.step()
        start = time.perf_counter()
        stepper.step()
    except (TypeError, ValueError, RuntimeError) as err:  # an optimizer that is not a plain torch one
        logger.debug("offload probe: cannot rebuild %s to time it (%s)", type(optimizer).__name__, err)
        return None
    return numel / max(time.perf_counter() - start, 1e-9)


def _advice(text: str, setting: str | None = None, saving: float | None = None) -> dict:
    return {"text": text, "setting": setting, "saves_up_to_s": saving}


def diagnose(report: dict, probes: OffloadProbes, traffic: dict[str, tuple[int, int]], layout: dict | None,
             host_elements: int, config: Any) -> dict:
    """The step's offload figures and advice ([Note: the offload diagnosis]). `report`: the step
    breakdown (zerodp/timers.py); `traffic`: per swap store the (read, written) bytes of the step;
    `layout`: the optimizer's swap chunks (OptimizerSwapper.layout) or None; `host_elements`: the
    elements the host optimizer steps (0 when the optimizer is on the device)."""
    zero = config.zero_optimization
    step = max(report["seconds"], 1e-9)
    advice: list[dict] = []
    copies = _link_figures(advice, report, probes, zero, step)
    disks, floor = _disk_figures(traffic, probes)
    probed = any(d["floor_seconds"] is not None for d in disks.values())
    # the host optimizer, and the optimizer's swap pipeline
    cpu_step = report["optimizer"] if host_elements else 0.0
    rate = probes.optimizer_elements_per_s
    host = {"seconds": cpu_step, "elements": host_elements,
            "probe_seconds": host_elements / rate if host_elements and rate else None}
    explained = False
    if layout is not None and layout["chunks"]:
        explained = _swap_pipeline_advice(advice, layout, cpu_step, host["probe_seconds"],
                                          disks.get("optimizer", {}).get("floor_seconds"), step, zero)
    if probed:
        _disk_advice(advice, report, traffic, floor, step, explained)
    _read_ahead_advice(advice, report, zero, step)
    if host_elements and cpu_step >= 0.3 * step and not explained:
        probe_s = "" if host["probe_seconds"] is None else f" (the start-up probe: {host['probe_seconds']:.3f} s)"
        advice.append(_advice(
            f"the CPU optimizer takes {cpu_step:.3f} s of the step's {step:.3f} s for {host_elements:,} elements"
            f"{probe_s} on {torch.get_num_threads()} threads; it runs once per optimizer step, so doubling "
            f"gradient_accumulation_steps (now {config.gradient_accumulation_steps}) halves its share per sample, "
            "and more CPU cores per rank shorten it", "gradient_accumulation_steps"))
    return {"copies": copies, "disk": disks, "disk_floor_seconds": floor if probed else None,
            "host_optimizer": host, "swap_layout": dict(layout) if layout is not None else None, "probes": probes.as_dict(), "advice": advice}


def _link_figures(advice: list[dict], report: dict, probes: OffloadProbes, zero: Any, step: float) -> dict:
    """The host-device link's bytes, wait and floor this step, with its advice (pinning, fewer bytes)."""
    copies = {"bytes": report["offload_bytes"], "seconds": report["offload_transfers"], "floor_seconds": None}
    link = probes.copy_GBps
    if link is None or not copies["bytes"]:
        return copies
    pinned, pageable = min(link["h2d_pinned"], link["d2h_pinned"]), min(link["h2d_pageable"], link["d2h_pageable"])
    copies["floor_seconds"] = copies["bytes"] / (pinned * 1e9)
    unpinned = [name for name in ("offload_optimizer", "offload_param")
                if (s := getattr(zero, name)) is not None and s.device == "cpu" and not s.pin_memory]
    if unpinned and copies["seconds"] >= _NOTABLE * step and pinned >= 1.5 * pageable:
        advice.append(_advice(
            f"host-device copies waited {copies['seconds']:.3f} s from pageable memory; the start-up probe copied "
            f"at {pinned:.1f} GB/s pinned against {pageable:.1f} pageable: set pin_memory true in "
            f"{' and '.join(unpinned)}", f"{unpinned[0]}.pin_memory", copies["seconds"] * (1 - pageable / pinned)))
    if copies["floor_seconds"] >= 0.5 * step:
        advice.append(_advice(
            f"the host-device link sets the pace: {copies['bytes'] / 1e6:,.1f} MB crossed it this step, at least "
            f"{copies['floor_seconds']:.3f} s at the probed {pinned:.1f} GB/s of the step's {step:.3f} s; fewer bytes "
            "cross with offload_param off when the parameters fit (zerodp estimate), and more "
            "gradient_accumulation_steps spread the optimizer's copies (once per step) over more samples"))
    return copies


def _disk_figures(traffic: dict[str, tuple[int, int]], probes: OffloadProbes) -> tuple[dict, float]:
    """Per swap store its bytes read and written and the seconds they need at the probed bandwidth (None
    unprobed), and the sum of those floors."""
    disks, floor = {}, 0.0
    for name, (read, written) in traffic.items():
        probe = probes.disk.get(name)
        seconds = None
        if probe is not None and probe.read_MBps > 0 and probe.write_MBps > 0:
            seconds = read / (probe.read_MBps * 1e6) + written / (probe.write_MBps * 1e6)
            floor += seconds
        disks[name] = {"read_bytes": read, "written_bytes": written, "floor_seconds": seconds}
    return disks, floor


def _disk_advice(advice: list[dict], report: dict, traffic: dict[str, tuple[int, int]], floor: float, step: float,
                 explained: bool) -> None:
    """The disk setting the pace (unless the swap pipeline's advice explained the step), or slower than probed."""
    if not explained and floor >= 0.5 * step:
        advice.append(_advice(
            f"the disk sets the pace: this step read {sum(r for r, _ in traffic.values()) / 1e6:,.1f} MB and wrote "
            f"{sum(w for _, w in traffic.values()) / 1e6:,.1f} MB, at least {floor:.3f} s at the probed bandwidth, of "
            f"its {step:.3f} s; no buffer_count or sub_group_size goes below that. What does: a faster disk or one per "
            "rank (nvme_path), more gradient_accumulation_steps (the optimizer's swap traffic is once per optimizer "
            "step), or offload_optimizer.device cpu where host memory holds its 12 bytes per owned element"))
    if report["nvme_wait"] > 1.5 * floor + _NOTABLE * step:
        advice.append(_advice(
            f"the step waited {report['nvme_wait']:.3f} s on the disk where the start-up probe's bandwidth needs "
            f"{floor:.3f} s: the disk is slower than at start-up (another process using it, or a drive whose write "
            "cache filled under sustained writes)"))


def _read_ahead_advice(advice: list[dict], report: dict, zero: Any, step: float) -> None:
    """Forward and backward waiting on parameter shards read from NVMe that the read-ahead could hide."""
    in_passes = report["nvme_wait"] - report["nvme_wait_in_step"]
    passes = report["forward"] + report["backward"]  # what a read ahead hides behind
    section = zero.offload_param
    if min(in_passes, passes) < _NOTABLE * step or section is None or section.device != "nvme":
        return
    advice.append(_advice(
        f"forward and backward waited {in_passes:.3f} s for parameter shards read from the disk beside "
        f"{passes:.3f} s of compute to read them behind: offload_param.buffer_count ({section.buffer_count} units) "
        f"and buffer_count x buffer_size ({section.buffer_size:,} elements) bound the read-ahead, and max_in_cpu "
        f"({section.max_in_cpu:,} elements) keeps shards in host memory: raise them as host memory allows",
        "offload_param.buffer_count", min(in_passes, passes)))


def _swap_pipeline_advice(advice: list[dict], layout: dict, cpu_step: float, probe_step: float | None,
                          disk_floor: float | None, step: float, zero: Any) -> bool:
    """The swap pipeline's advice (chunk overhead, one chunk, buffer_count 1); True if any applied."""
    chunks, elements, buffers = layout["chunks"], layout["elements"], layout["buffer_count"]
    stage12 = zero.stage in (1, 2)
    overhead = cpu_step - probe_step if probe_step is not None else 0.0
    per_chunk = overhead / chunks
    fewer = max(_PIPELINED_CHUNKS, math.floor(0.05 * step / per_chunk)) if per_chunk > 0 else chunks
    if overhead >= _NOTABLE * step and fewer <= chunks / 2:
        where = (f"raise zero_optimization.sub_group_size from {zero.sub_group_size:,} to about "
                 f"{_chunk_numel(elements, fewer):,} ({fewer} chunks; host memory then holds {buffers} of them, "
                 "12 bytes per element)" if stage12 else
                 "at stage 3 each unit is a chunk: fewer, larger units (zerodp.zero.set_z3_leaf_modules) cut it")
        advice.append(_advice(
            f"{overhead:.3f} s of the CPU step's {cpu_step:.3f} s is a fixed cost per swap chunk ({chunks} chunks, "
            f"{per_chunk * 1e3:.1f} ms each; the start-up probe steps the same {elements:,} elements in "
            f"{probe_step:.3f} s): {where}", "zero_optimization.sub_group_size" if stage12 else None,
            overhead * (1 - min(fewer, chunks) / chunks)))
        return True
    if disk_floor is None or min(disk_floor, cpu_step) < _NOTABLE * step:
        return False
    hidden = min(disk_floor, cpu_step)
    if chunks == 1 and stage12:
        advice.append(_advice(
            f"the optimizer state is one swap chunk (sub_group_size {zero.sub_group_size:,} >= its {elements:,} "
            f"elements): its read, the CPU step ({cpu_step:.3f} s) and its write (the disk needs {disk_floor:.3f} s) "
            f"run one after another; sub_group_size {_chunk_numel(elements, 4):,} makes 4 chunks whose disk I/O "
            "overlaps the CPU step", "zero_optimization.sub_group_size", hidden * 0.75))
        return True
    if chunks > 1 and buffers == 1:
        advice.append(_advice(
            f"offload_optimizer.buffer_count 1 runs each chunk's read, CPU step and write one after another "
            f"(the CPU step {cpu_step:.3f} s, the disk {disk_floor:.3f} s); buffer_count 3 overlaps them",
            "offload_optimizer.buffer_count", hidden * (1 - 1 / chunks)))
        return True
    return False


def _chunk_numel(elements: int, chunks: int) -> int:
    """The sub_group_size that cuts `elements` into about `chunks` swap chunks (CHUNK_ALIGN_NUMEL multiples)."""
    return -(-elements // (chunks * CHUNK_ALIGN_NUMEL)) * CHUNK_ALIGN_NUMEL
