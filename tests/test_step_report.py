"""engine.step_report(): where a step's seconds go, and the verdict, on configurations built to be
bound by one part each (by a wide margin, so that a busy machine does not change the answer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import zerodp
from tests.harness import run_ranks
from tests.netns import slow_loopback

ROOT = Path(__file__).resolve().parent.parent

PARTS = ("forward", "backward", "communication_exposed", "optimizer", "offload_transfers", "nvme_wait", "input")


class Wide(nn.Module):
    """A large embedding read at one token: 12.8M parameters to reduce and step, next to no compute."""

    def __init__(self, rows: int = 100_000) -> None:
        super().__init__()
        self.embed = nn.Embedding(rows, 128)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx).square().mean()


class Flat(nn.Module):
    """One parameter, one element of it read: little to compute beyond its gradient's fill."""

    def __init__(self, numel: int = 12_800_000) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(numel))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return self.weight[0] * scale


class Deep(nn.Module):
    """1M parameters and a large batch: compute dwarfs their communication and update."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _train(model: nn.Module, config: dict, inputs, steps: int = 3) -> list[dict]:
    torch.manual_seed(0)
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, **config})
    assert engine.step_report() is None  # no step has finished
    reports = []
    for step in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(inputs()))
            engine.step()
        reports.append(engine.step_report())
    return reports[1:]  # the first step pays for warm-up


def _sgd(stage: int) -> dict:
    return {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}


def _compute_bound(rank: int, world_size: int) -> list[dict]:
    torch.manual_seed(rank)
    x = torch.randn(4096, 512)
    return _train(Deep(), _sgd(1), lambda: x)


def _one_rank(rank: int, world_size: int, nvme: str) -> dict:
    def slow_input():
        time.sleep(0.1)  # a data loader that cannot keep up
        return torch.tensor([0])

    on_disk = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    # 12.8M elements: 205 MB of AdamW state (fp32 master and moments) swapped in and out every step
    return {"offload": _train(Flat(), on_disk, lambda: torch.tensor(1.0)),
            "input": _train(Wide(rows=8), {**_sgd(0), "gradient_accumulation_steps": 2}, slow_input)}


def _check(reports: list[dict], bound: str) -> None:
    for report in reports:
        assert report["verdict"] == f"{bound}-bound", report
        assert report["seconds"] == pytest.approx(sum(report[p] for p in PARTS), rel=1e-6, abs=1e-6)
        assert all(report[p] >= 0 for p in PARTS), report
        assert report["share"] == pytest.approx(report["parts_seconds"][bound] / report["seconds"])
        assert 0.0 <= (report["overlap_ratio"] or 0.0) <= 1.0


def test_a_compute_bound_step_on_two_ranks() -> None:
    for reports in run_ranks(_compute_bound, world_size=2):
        _check(reports, "compute")


_OVER_THE_NETWORK = """
import json, sys, torch
from tests.test_step_report import Flat, _sgd, _train
reports = _train(Flat(1_000_000), {**_sgd(0), "gradient_clipping": 0.0}, lambda: torch.tensor(1.0))
if torch.distributed.get_rank() == 0:
    json.dump(reports, open(sys.argv[1], "w"))
"""


def test_a_communication_bound_step_over_a_slow_network(tmp_path) -> None:
    """2 ranks on one host whose network carries 200 Mbit/s: stage 0's all-reduce of 4 MB per step
    takes ~0.3 s, the rest milliseconds."""
    script, out = tmp_path / "job.py", tmp_path / "reports.json"
    script.write_text(_OVER_THE_NETWORK)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with slow_loopback("200mbit") as host:
        job = host.popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(out)], env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = job.communicate(timeout=240)
        finally:
            job.kill()
    assert job.returncode == 0, log[-3000:]
    reports = json.loads(out.read_text())
    _check(reports, "communication")
    assert all(r["communication_exposed"] > 5 * (r["forward"] + r["backward"] + r["optimizer"]) for r in reports)


def test_offload_and_input_bound_steps(tmp_path) -> None:
    [reports] = run_ranks(_one_rank, world_size=1, args=(str(tmp_path),))
    _check(reports["offload"], "offload")
    assert all(r["optimizer_on"] == "host" and r["nvme_wait"] > r["optimizer"] for r in reports["offload"])
    _check(reports["input"], "input")
    assert all(r["input"] >= 0.2 for r in reports["input"])  # two micro-batches waited 0.1 s each


class _HostTimedEvent:
    """torch.cuda.Event's timing interface (record, synchronize, elapsed_time in ms) on the host's
    clock: the CUDA clock's arithmetic, run where there is no device."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: None = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: "_HostTimedEvent") -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def _nap(seconds: float) -> float:
    """Sleep; the seconds it took (more than asked on a busy machine)."""
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


@pytest.mark.parametrize("clock", ["host", "cuda-events"])
def test_the_clock_splits_a_scripted_step_into_its_parts(clock: str, monkeypatch) -> None:
    from zerodp.metrics import format_breakdown
    from zerodp.timers import StepClock, in_flight, launched, waiting

    if clock == "cuda-events":
        monkeypatch.setattr(torch.cuda, "Event", _HostTimedEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    step = StepClock(torch.device("cuda" if clock == "cuda-events" else "cpu"))
    for _ in range(2):  # the second step begins where the first ended
        took = {}
        with step.phase("forward"):
            took["forward"] = _nap(0.1)
            flight = launched()  # an async collective, waited for in backward
            with waiting("offload", 1000):
                took["offload_transfers"] = _nap(0.02)
        with step.phase("backward"):
            took["backward"] = _nap(0.03)
            with waiting("communication"):
                took["communication_exposed"] = _nap(0.04)
            in_flight(flight)
        with step.phase("step"), waiting("nvme"), waiting("communication"):  # nested: counted once, as the disk's
            took["nvme_wait"] = took["nvme_wait_in_step"] = _nap(0.05)
        took["input"] = _nap(0.06)  # outside the engine's calls: the data loader's
        report = step.take(offloaded_optimizer=False)
        assert report["clock"] == clock
        took["optimizer"] = 0.0
        took["communication_overlapped"] = took["offload_transfers"] + took["backward"]  # launch to the wait
        for part, seconds in took.items():
            assert report[part] == pytest.approx(seconds, abs=0.02), (part, report)
        assert report["offload_bytes"] == 1000
        assert report["seconds"] == pytest.approx(sum(report[p] for p in PARTS), abs=1e-6)
        assert report["verdict"] == "compute-bound", report  # 0.13 s of compute against 0.06 s of input
        assert format_breakdown(report).endswith("[cuda events]") == (clock == "cuda-events")
