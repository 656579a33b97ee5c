"""`zerodp plan`: the step-time arithmetic, the search on a small model, the CLI and its config."""

from __future__ import annotations

import json

import pytest

from zerodp.cli import main
from zerodp.plan.cluster import Cluster, Work, step_time


def test_step_time_adds_its_parts_by_hand() -> None:
    cluster = Cluster(gpus_per_node=4, peak_flops=1e12, efficiency=0.5, micro_batch_overhead=0.01,
                      intra_node_bandwidth=1e9, collective_latency=0.001, overlap=0.5, device_adam_rate=1e6,
                      host_adam_rate=4e6, host_device_bandwidth=1e9)
    work = Work(flops_per_micro=1e12, accumulation=2, comm_bytes={"all_reduce": 4e9}, comm_calls={"all_reduce": 10},
                optimizer_numel=2_000_000, grad_bytes=10**8, param_shard_bytes=10**8)
    t = step_time(work, cluster)
    assert t.compute == pytest.approx(2 * (0.01 + 2.0))  # 1e12 FLOPs at 0.5e12 FLOP/s
    assert t.communication == pytest.approx(4e9 * 3 / 4 / 1e9 + 0.01)  # a ring moves (N-1)/N
    assert t.exposed_communication == pytest.approx(t.communication * 0.5)  # half of it hidden behind compute
    assert t.optimizer == pytest.approx(2.0) and t.offload == 0
    offloaded = step_time(Work(1e12, 2, {}, {}, 2_000_000, 10**8, 10**8, "cpu", "cpu"), cluster)
    assert offloaded.optimizer == pytest.approx(2_000_000 / (4e6 / 4))  # the node's cores shared by its 4 ranks
    assert offloaded.offload == pytest.approx((2 * 10**8 + 2 * 2 * 10**8) / 1e9)  # grads down, params up; fetches


def test_plan_picks_what_fits_and_writes_a_config_zerodp_accepts(tmp_path, capsys) -> None:
    from zerodp.config import load_config
    from zerodp.config.keys import NO_EFFECT, value_at
    from zerodp.plan.cluster import gpu_cluster
    from zerodp.plan.workload import workload
    from zerodp.plan.planner import plan

    work = workload("demo")
    roomy = plan(work, gpu_cluster("cpu", gpus_per_node=2, gpu_memory_bytes=10**9), 32, 16, "fp32", ("none",))
    assert roomy.candidates[0].micro_batch == 8 and roomy.candidates[0].accumulation == 1
    reference = roomy.candidates[0].peak_bytes
    budget = int(reference * 0.6)
    out = tmp_path / "ds.json"
    assert main(["plan", "demo", "--gpu", "cpu", "--gpus-per-node", "2", "--gpu-memory", str(budget),
                 "--seq-len", "32", "--global-batch", "16", "--dtype", "fp32", "--output", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    tight = printed["candidates"]
    assert tight, printed["why"]
    for c in tight:
        assert c["peak_bytes"] <= budget
        assert c["micro_batch"] * c["gradient_accumulation_steps"] == 8
    totals = [c["step_seconds"]["total"] for c in tight]
    assert totals == sorted(totals)
    assert tight[0]["micro_batch"] < 8 or tight[0]["activation_checkpointing"] != "none" or tight[0]["stage"] > 0
    assert printed["best_config"] == json.loads(out.read_text())
    config = load_config(str(out), world_size=2)
    assert config.train_batch_size == 16 and config.zero_optimization.stage == tight[0]["stage"]
    for c in roomy.candidates:  # no key a plan writes is one zerodp would warn has no effect
        config = load_config(c.ds_config(16), world_size=2)
        assert [p for p, (default, _) in NO_EFFECT.items() if (v := value_at(config, p))[1] and v[0] != default] == []


def test_plan_names_each_bad_flag(capsys) -> None:
    assert main(["plan", "demo", "--gpus-per-node", "3", "--seq-len", "999", "--global-batch", "16",
                 "--gpu-memory", "lots", "--overlap", "2"]) == 2
    err = capsys.readouterr().err
    assert "--global-batch 16: not a multiple of the 3 ranks" in err
    assert "--seq-len 999: demo takes at most 32 tokens" in err
    assert "--gpu-memory 'lots'" in err and "--overlap '2'" in err
    assert main(["plan", "demo", "--gpu", "tpu", "--seq-len", "8", "--global-batch", "8"]) == 2
    assert "--gpu 'tpu': expected one of a100-40gb" in capsys.readouterr().err
