"""engine.step_report()["offload"]: what an offloaded step waits on and which setting would help
(zerodp/offload/diagnosis.py's [Note: the offload diagnosis]).

The rules are checked on steps described by their figures (a GPU's link included, which this machine
has not); one real NVMe run checks the byte counts, the probes and the chunk-overhead advice end to end."""

from __future__ import annotations

import pytest
import torch

import zerodp
from tests.harness import run_ranks
from tests.test_step_report import Flat
from zerodp.config import load_config
from zerodp.offload.diagnosis import OffloadProbes, diagnose
from zerodp.offload.nvme import BandwidthResult

MB = 10**6


def _config(offload_optimizer: dict | None = None, offload_param: dict | None = None, stage: int = 2, **zero):
    sections = {k: v for k, v in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)) if v}
    return load_config({"train_batch_size": 1, "zero_optimization": {"stage": stage, **sections, **zero}}, world_size=1)


def _report(seconds: float, optimizer: float = 0.0, forward: float = 0.0, backward: float = 0.0, nvme_wait: float = 0.0, nvme_wait_in_step: float | None = None,
            offload_transfers: float = 0.0, offload_bytes: int = 0) -> dict:
    return {"seconds": seconds, "forward": forward, "backward": backward, "optimizer": optimizer, "nvme_wait": nvme_wait,
            "nvme_wait_in_step": nvme_wait if nvme_wait_in_step is None else nvme_wait_in_step,
            "offload_transfers": offload_transfers, "offload_bytes": offload_bytes}


_DISK = OffloadProbes(disk={"optimizer": BandwidthResult(64 << 20, True, write_MBps=1500.0, read_MBps=1000.0)},
                      optimizer_elements_per_s=1e9)
_NVME = {"device": "nvme", "nvme_path": "/nvme"}
_TRAFFIC = {"optimizer": (150 * MB, 150 * MB)}  # the disk needs 0.15 + 0.10 = 0.25 s for it


def _settings(result: dict) -> list:
    return [a["setting"] for a in result["advice"]]


def test_the_floors_are_the_bytes_at_the_probed_bandwidths() -> None:
    result = diagnose(_report(1.0, optimizer=0.05, nvme_wait=0.3), _DISK, _TRAFFIC,
                      {"chunks": 13, "elements": 12_500_000, "largest_chunk": 1_000_000, "buffer_count": 4},
                      12_500_000, _config(_NVME))
    assert result["disk"]["optimizer"] == {"read_bytes": 150 * MB, "written_bytes": 150 * MB,
                                           "floor_seconds": pytest.approx(0.25)}
    assert result["host_optimizer"] == {"seconds": 0.05, "elements": 12_500_000, "probe_seconds": pytest.approx(0.0125)}
    assert result["advice"] == []  # 0.3 s of a 1 s step is the disk's floor and little more; nothing to change


def test_a_disk_bound_step_says_no_setting_goes_below_the_floor() -> None:
    layout = {"chunks": 13, "elements": 12_500_000, "largest_chunk": 1_000_000, "buffer_count": 4}
    result = diagnose(_report(0.4, optimizer=0.02, nvme_wait=0.3), _DISK, _TRAFFIC, layout, 12_500_000, _config(_NVME))
    [advice] = result["advice"]
    assert advice["text"].startswith("the disk sets the pace") and "0.250 s" in advice["text"]
    assert "no buffer_count or sub_group_size goes below that" in advice["text"]


def test_one_swap_chunk_serialises_the_disk_and_the_cpu_step() -> None:
    layout = {"chunks": 1, "elements": 12_800_000, "largest_chunk": 12_800_000, "buffer_count": 4}
    result = diagnose(_report(0.6, optimizer=0.1, nvme_wait=0.25), _DISK, _TRAFFIC, layout, 12_800_000, _config(_NVME))
    [advice] = result["advice"]
    assert advice["setting"] == "zero_optimization.sub_group_size"
    assert "sub_group_size 3,200,000 makes 4 chunks" in advice["text"]  # a multiple of 512
    assert advice["saves_up_to_s"] == pytest.approx(0.075)  # 3/4 of the CPU step hides behind the disk


def test_buffer_count_1_serialises_every_chunk() -> None:
    layout = {"chunks": 10, "elements": 100_000_000, "largest_chunk": 10_000_000, "buffer_count": 1}
    result = diagnose(_report(0.6, optimizer=0.12, nvme_wait=0.25), _DISK, _TRAFFIC, layout, 100_000_000,
                      _config({**_NVME, "buffer_count": 1}))
    assert _settings(result) == ["offload_optimizer.buffer_count"]
    assert result["advice"][0]["saves_up_to_s"] == pytest.approx(0.12 * 0.9)


def test_a_fixed_cost_per_small_chunk_asks_for_a_larger_sub_group_size() -> None:
    """1,000 chunks of 10,000 elements: the CPU step takes 1.5 s where the probe steps the 10M
    elements in 0.01 s: 1.49 ms a chunk. To make it 5% of the 2 s step: 67 chunks."""
    layout = {"chunks": 1000, "elements": 10_000_000, "largest_chunk": 10_000, "buffer_count": 4}
    result = diagnose(_report(2.0, optimizer=1.5, nvme_wait=0.4), _DISK, _TRAFFIC, layout, 10_000_000,
                      _config(_NVME, sub_group_size=10_000))
    advice = result["advice"][0]
    assert advice["setting"] == "zero_optimization.sub_group_size"
    assert "1.490 s of the CPU step's 1.500 s is a fixed cost per swap chunk (1000 chunks, 1.5 ms each" in advice["text"]
    assert "from 10,000 to about 149,504 (67 chunks" in advice["text"]
    assert advice["saves_up_to_s"] == pytest.approx(1.49 * (1 - 67 / 1000))
    at_stage_3 = diagnose(_report(2.0, optimizer=1.5, nvme_wait=0.4), _DISK, _TRAFFIC, layout, 10_000_000,
                          _config(_NVME, stage=3))
    assert "set_z3_leaf_modules" in at_stage_3["advice"][0]["text"] and _settings(at_stage_3)[0] is None


def test_waits_beyond_the_floor_say_the_disk_is_slower_than_at_start_up() -> None:
    layout = {"chunks": 13, "elements": 12_500_000, "largest_chunk": 1_000_000, "buffer_count": 4}
    result = diagnose(_report(1.5, optimizer=0.02, nvme_wait=1.2), _DISK, _TRAFFIC, layout, 12_500_000, _config(_NVME))
    assert [a["text"].split(":")[0] for a in result["advice"]] == [
        "the step waited 1.200 s on the disk where the start-up probe's bandwidth needs 0.250 s"]


def test_parameter_reads_waited_in_forward_and_backward_name_the_read_ahead_settings() -> None:
    probes = OffloadProbes(disk={"parameters": BandwidthResult(8 << 20, True, 1500.0, 1000.0)})
    report = _report(1.0, forward=0.2, backward=0.2, nvme_wait=0.5, nvme_wait_in_step=0.05)
    result = diagnose(report, probes, {"parameters": (400 * MB, 10 * MB)}, None, 0, _config(offload_param=_NVME, stage=3))
    assert _settings(result) == ["offload_param.buffer_count"]
    assert "forward and backward waited 0.450 s for parameter shards read from the disk beside 0.400 s" in \
        result["advice"][0]["text"]
    assert result["advice"][0]["saves_up_to_s"] == pytest.approx(0.4)
    no_compute = diagnose(_report(1.0, nvme_wait=0.5, nvme_wait_in_step=0.05), probes,
                          {"parameters": (400 * MB, 10 * MB)}, None, 0, _config(offload_param=_NVME, stage=3))
    assert no_compute["advice"] == []  # nothing to read behind


def test_a_cpu_optimizer_bound_step_points_at_accumulation_and_cores() -> None:
    result = diagnose(_report(1.0, optimizer=0.6), OffloadProbes(optimizer_elements_per_s=1e9), {}, None, 100_000_000,
                      _config({"device": "cpu"}))
    assert _settings(result) == ["gradient_accumulation_steps"]
    assert "0.600 s of the step's 1.000 s for 100,000,000 elements (the start-up probe: 0.100 s)" in result["advice"][0]["text"]


_LINK = {"h2d_pinned": 25.0, "d2h_pinned": 20.0, "h2d_pageable": 8.0, "d2h_pageable": 6.0}


def test_pageable_copies_ask_for_pinned_memory_and_a_link_bound_step_says_so() -> None:
    report = _report(1.0, offload_transfers=0.4, offload_bytes=2 * 10**9)
    unpinned = diagnose(report, OffloadProbes(copy_GBps=_LINK), {}, None, 0,
                        _config({"device": "cpu", "pin_memory": False}))
    assert unpinned["copies"]["floor_seconds"] == pytest.approx(0.1)  # 2 GB at 20 GB/s
    assert _settings(unpinned) == ["offload_optimizer.pin_memory"]
    assert unpinned["advice"][0]["saves_up_to_s"] == pytest.approx(0.4 * (1 - 6 / 20))
    pinned = diagnose(report, OffloadProbes(copy_GBps=_LINK), {}, None, 0, _config({"device": "cpu"}))
    assert pinned["advice"] == []
    link_bound = diagnose(_report(1.0, offload_transfers=0.7, offload_bytes=12 * 10**9), OffloadProbes(copy_GBps=_LINK),
                          {}, None, 0, _config({"device": "cpu"}))
    assert link_bound["advice"][0]["text"].startswith("the host-device link sets the pace: 12,000.0 MB crossed it")


def test_without_probes_the_report_gives_what_it_measured_and_no_floors() -> None:
    result = diagnose(_report(1.0, optimizer=0.5, nvme_wait=0.4), OffloadProbes(skipped=True), _TRAFFIC,
                      {"chunks": 1, "elements": 100, "largest_chunk": 100, "buffer_count": 4}, 100, _config(_NVME))
    assert result["disk_floor_seconds"] is None and result["disk"]["optimizer"]["floor_seconds"] is None
    assert result["probes"]["skipped"] and _settings(result) == ["gradient_accumulation_steps"]


def _small_chunks(rank: int, world_size: int, nvme: str) -> list[dict]:
    """1.28M elements of AdamW state in swap chunks of 10,240 elements: 125 chunks, each paying the
    pipeline's fixed cost (about a millisecond here) for 40 KB of master."""
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "sub_group_size": 10_240,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, *_ = zerodp.initialize(model=Flat(1_280_000), config=config)
    reports = []
    for _ in range(3):
        engine.backward(engine(torch.tensor(1.0)))
        engine.step()
        reports.append(engine.step_report())
    return reports[1:]


def test_an_nvme_step_counts_its_disk_bytes_and_asks_for_fewer_chunks(tmp_path) -> None:
    [reports] = run_ranks(_small_chunks, world_size=1, args=(str(tmp_path),))
    for report in reports:
        offload = report["offload"]
        # read and written each step: the fp32 master and AdamW's two moments, 12 bytes per element
        assert offload["disk"]["optimizer"]["read_bytes"] == offload["disk"]["optimizer"]["written_bytes"] == 12 * 1_280_000
        assert offload["swap_layout"] == {"chunks": 125, "elements": 1_280_000, "largest_chunk": 10_240, "buffer_count": 4}
        probe = offload["probes"]["disk"]["optimizer"]
        assert probe["probe_bytes"] == 14 << 20 and probe["read_MBps"] > 0 and probe["write_MBps"] > 0
        assert offload["disk_floor_seconds"] > 0 and offload["host_optimizer"]["probe_seconds"] > 0
        assert offload["advice"][0]["setting"] == "zero_optimization.sub_group_size", offload["advice"]
