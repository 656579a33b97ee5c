"""The flops profiler (`flops_profiler`): its counts against torch's FlopCounterMode over the same
micro-batch on meta tensors, its per-module rows, its output file, and the FLOPs it lends
engine.step_report()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerodp
from tests.harness import run_ranks
from zerodp.config import ConfigError

MICRO_BATCH, SEQ_LEN, GAS = 2, 16, 2


def _counted(work, model: nn.Module) -> int:
    """FlopCounterMode over one forward and backward of the unpartitioned `model`, on this CPU (on
    meta tensors the count differs: attention takes another kernel there)."""
    from torch.utils.flop_counter import FlopCounterMode

    args, kwargs = work.inputs(model, MICRO_BATCH, SEQ_LEN, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        model(*args, **kwargs).backward()
    return counter.get_total_flops()


def _profiled(rank: int, world: int, out: str) -> dict:
    from zerodp import checkpointing
    from zerodp.plan.workload import workload

    work = workload("demo")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(work.build())
        checkpointing.apply(models[-1], "blocks")  # its recomputation runs in the backward and is counted there
    model, reference = models
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3},
              "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 2, "output_file": out}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    before, reports = None, []
    for step in range(3):
        for _ in range(GAS):
            args, kwargs = work.inputs(model, MICRO_BATCH, SEQ_LEN, engine.device)
            engine.backward(engine(*args, **kwargs))
            engine.step()
        if step == 0:
            before = engine.flops_profile
        reports.append(engine.step_report())
    torch.manual_seed(0)
    frozen = work.build()
    scorer, *_ = zerodp.initialize(model=frozen, config={"train_batch_size": MICRO_BATCH * world,
                                                         "flops_profiler": {"enabled": True}})
    with torch.no_grad():  # an engine that does not train (no optimizer): its second forward
        for _ in range(2):
            scorer(*work.inputs(frozen, MICRO_BATCH, SEQ_LEN, scorer.device)[0])
    return {"before": before, "profile": engine.flops_profile, "reports": reports, "scored": scorer.flops_profile,
            "numel": sum(p.ds_numel for p in model.parameters()),
            "expected": _counted(work, reference)}


def test_the_profile_counts_the_micro_batch_and_feeds_the_step_report(tmp_path) -> None:
    out = tmp_path / "flops.txt"
    results = run_ranks(_profiled, 2, args=(str(out),))
    for r in results:
        profile = r["profile"]
        assert r["before"] is None and profile["step"] == 2  # profile_step 1: the second step's first micro-batch
        assert profile["flops"] == profile["forward_flops"] + profile["backward_flops"] == r["expected"]
        assert profile["backward_flops"] > 2 * profile["forward_flops"]  # the backward's 2x, and the recompute
        root, *modules = profile["modules"]
        assert root["depth"] == 0 and root["params"] == r["numel"] and root["forward_flops"] == profile["forward_flops"]
        children = [m for m in modules if m["depth"] == 1]
        assert sum(m["forward_flops"] for m in children) <= root["forward_flops"]
        assert max(m["forward_flops"] for m in children) > 0 and all(m["forward_seconds"] >= 0 for m in modules)
        blocks = next(m for m in children if m["name"] == "blocks")  # an nn.ModuleList: never called itself
        assert blocks["calls"] == 0 and blocks["forward_flops"] == sum(
            m["forward_flops"] for m in modules if m["depth"] == 2 and m["name"].startswith("blocks.")) > 0
        first, second, third = r["reports"]
        assert first["flops"] is None and first["flops_per_s"] is None
        assert second["flops"] == third["flops"] == GAS * profile["flops"]
        assert third["flops_per_s"] == pytest.approx(third["flops"] / third["seconds"])
        scored = r["scored"]
        assert scored["step"] == 2 and scored["backward_flops"] is None
        assert scored["forward_flops"] == profile["forward_flops"] == scored["flops"]  # no recompute in a forward
    text = out.read_text()
    assert text.startswith("flops profile: step 2") and "top 2 module(s) per depth" in text
    assert "every module" in text  # detailed, DeepSpeed's default


def test_an_output_file_that_cannot_be_written_is_refused_before_any_communication(tmp_path) -> None:
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {}},
              "flops_profiler": {"enabled": True, "output_file": str(tmp_path / "missing" / "flops.txt")}}
    with pytest.raises(ConfigError, match="flops_profiler.output_file: .*missing.* create it"):
        zerodp.initialize(model=nn.Linear(2, 2), config=config)  # no process group exists here


def test_the_mfu_peak_comes_from_the_device_name(monkeypatch) -> None:
    from zerodp.metrics import format_breakdown
    from zerodp.profiler import device_peak_flops

    cuda = torch.device("cuda", 0)
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(cuda, torch.bfloat16) == 989e12 and device_peak_flops(cuda, torch.float32) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "NVIDIA A100-SXM4-40GB")
    assert device_peak_flops(cuda, torch.float16) == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "NVIDIA L4")
    assert device_peak_flops(cuda, torch.bfloat16) is None
    report = {"forward": 0.1, "backward": 0.2, "communication_exposed": 0.0, "communication_overlapped": 0.0,
              "optimizer": 0.0, "offload_transfers": 0.0, "nvme_wait": 0.0, "input": 0.0, "seconds": 0.3,
              "verdict": "compute-bound", "share": 1.0, "overlap_ratio": None, "flops_per_s": 2.5e14, "mfu": 0.2528}
    assert format_breakdown(report).endswith("(100%), 250000.0 GFLOP/s, MFU 25.3%")
