"""The OOM doctor (zerodp/plan/doctor.py), on the CPU through $ZERODP_DEVICE_MEMORY_LIMIT.

A run that crosses the limit stops in the phase where it did with one report per rank: the ledger,
what dominates, and remedies whose predicted savings hold: the first remedy's config, under the same
limit, trains.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_ranks


def _train(rank: int, world: int, zero: dict, micro_batch: int, limit: str, out: str) -> dict:
    import os

    import zerodp
    from zerodp.demo import DEMO_DEFAULT, TinyGPT
    from zerodp.plan.doctor import OutOfMemoryDiagnosed

    os.environ.update({"ZERODP_DEVICE_MEMORY_LIMIT": limit, "ZERODP_PREFLIGHT": "0", "ZERODP_DOCTOR_DIR": out})
    config = {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage3_param_persistence_threshold": 1000, **zero}}
    torch.manual_seed(0)
    engine, *_ = zerodp.initialize(model=TinyGPT(DEMO_DEFAULT), config=config)
    idx = torch.randint(0, DEMO_DEFAULT.vocab_size, (micro_batch, DEMO_DEFAULT.seq_len))
    try:
        for _ in range(3):
            engine.backward(engine(idx, idx))
            engine.step()
    except OutOfMemoryDiagnosed as err:
        return {"text": str(err), "report": err.report}
    return {"trained": engine.memory_report()["model_states"]}


def test_optimizer_state_over_the_limit_names_the_step_and_the_stage_that_fits(tmp_path) -> None:
    """The demo GPT at stage 0, bf16, 2 ranks holds 12.89 MB of model states per rank (Adam's state
    comes at the first step): under 16 MB the step runs out; the first remedy saves exactly what the
    estimator says, and its config trains under the same limit. (On a CPU the limit counts host
    memory too, the same memory: offload is no remedy there.)"""
    from zerodp.cli import main
    from zerodp.demo import DEMO_DEFAULT, TinyGPT
    from zerodp.plan.model_states import StrategySpec as Strategy, flat_states, module_flats, buffer_bytes

    outs = run_ranks(_train, 2, args=({"stage": 0}, 8, "16MB", str(tmp_path)))
    report = outs[0]["report"]
    assert report["phase"] == "step" and report["dominant"] == "optimizer state and fp32 masters"
    assert report["live_bytes"] > 16_000_000 and report["limit_bytes"] == 16_000_000
    assert report["held"]["param16"] == {"device": 1_611_264}
    first = report["remedies"][0]
    assert first["exact"] and first["remedy"] == "zero_optimization.stage 0 -> 3"
    with torch.device("meta"):
        model = TinyGPT(DEMO_DEFAULT)
    stage3 = flat_states(module_flats(model, 3, 2, 1000), 2, Strategy(3), buffer_bytes=buffer_bytes(model))
    assert first["saves_bytes"] == 12_890_320 - stage3.bytes("device")
    assert all("offload" not in r["remedy"] for r in report["remedies"])
    assert "in the step" in outs[0]["text"] and "remedies, in order" in outs[0]["text"]
    fixed = run_ranks(_train, 2, args=({"stage": 3}, 8, "16MB", str(tmp_path / "again")))
    assert all("trained" in out for out in fixed), fixed
    assert main(["doctor", str(tmp_path)]) == 0
    assert main(["doctor", str(tmp_path / "rank0.json"), "--json"]) == 0


def test_activations_over_the_limit_name_the_module_and_every_rank_reports(tmp_path, capsys) -> None:
    """Stage 3, 2 ranks, a micro-batch of 64: the activations outgrow the model states (6.45 MB); both
    ranks stop in the same phase and module, remedies led by a smaller micro-batch, and a micro-batch
    of 8 fits under the same 20 MB limit (`zerodp estimate` of this case: 44.6 MB at 64, 12.7 MB at 8)."""
    from zerodp.cli import main

    outs = run_ranks(_train, 2, args=({"stage": 3}, 64, "20MB", str(tmp_path)))
    for rank, out in enumerate(outs):
        report = out["report"]
        assert report["rank"] == rank and report["phase"] in ("forward", "backward")
        assert report["dominant"] == "activations and temporaries"
        assert report["remedies"][0]["remedy"].startswith("train_micro_batch_size_per_gpu 64 -> 32")
        if report["phase"] == "forward":
            assert report["module"].startswith("TinyGPT")
    assert [o["report"]["module"] for o in outs] == [outs[0]["report"]["module"]] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]
    assert main(["doctor", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.count("out of device memory on rank") == 2
    assert all("trained" in o for o in run_ranks(_train, 2, args=({"stage": 3}, 8, "20MB", str(tmp_path / "b"))))


def test_zerodp_doctor_names_a_path_without_reports(tmp_path, capsys) -> None:
    from zerodp.cli import main

    assert main(["doctor", str(tmp_path)]) == 2
    assert "no OOM doctor report there" in capsys.readouterr().err
    (tmp_path / "rank0.json").write_text("not json")
    assert main(["doctor", str(tmp_path)]) == 1  # bad data, not a bad argument (issue 38)
    assert "not a doctor report" in capsys.readouterr().err


def _watched(rank: int, world: int) -> bool:
    import zerodp
    from zerodp.demo import DEMO_DEFAULT, TinyGPT

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerodp.initialize(model=TinyGPT(DEMO_DEFAULT), config=config)
    return engine.doctor.watch is not None


def test_without_a_limit_on_the_cpu_nothing_is_watched() -> None:
    assert run_ranks(_watched, 1) == [False]
