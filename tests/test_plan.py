"""`zerodp plan`: the step-time arithmetic, the search on a small model, the CLI and its config."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zerodp.cli import main
from zerodp.plan.cluster import Cluster, StepTime, Work, step_time
from zerodp.plan.model_states import StrategySpec


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


# Ulysses' all-to-alls: priced inside their group of S ranks ([Note: pricing Ulysses' all-to-all])
HANDED, CALLS = 8e9, 4  # bytes each rank hands to all-to-alls in one step, and its calls
LINKS = dict(intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, collective_latency=0.001)


def _exchange(sp: int, **cluster: int) -> "StepTime":
    work = Work(1e12, 1, {"all_to_all": HANDED}, {"all_to_all": CALLS}, 0, 0, 0, sequence_parallel=sp)
    return step_time(work, Cluster(**LINKS, **cluster))


@pytest.mark.parametrize("sp, sent", [(2, 1 / 2), (4, 3 / 4)])
def test_an_all_to_all_within_a_node_sends_s_minus_1_over_s_at_the_node_s_bandwidth(sp, sent) -> None:
    for nodes in (1, 2):  # the group is 2 or 4 consecutive ranks of one node either way
        t = _exchange(sp, gpus_per_node=8, nodes=nodes)
        assert t.all_to_all == pytest.approx(HANDED * sent / 100e9 + CALLS * 0.001)  # S=2: 0.044 s, S=4: 0.064 s
        assert t.communication == t.exposed_communication == t.all_to_all  # the attention waits for it


def test_an_all_to_all_across_nodes_sends_each_peer_s_share_over_its_own_link() -> None:
    """S = 8 over 2 nodes of 4: each rank sends 3/8 to its node's peers (3e9 B at 100 GB/s = 0.03 s) and,
    at the same time, 4/8 to the other node's (4e9 B at 10 GB/s = 0.4 s): the slower, 0.4 s, + 4 calls."""
    assert _exchange(8, gpus_per_node=4, nodes=2).all_to_all == pytest.approx(0.4 + 0.004)
    # groups of 4 on nodes of 6: ranks 4-7 straddle nodes 0 and 1, 2 + 2; each sends 2/4 off its node
    assert _exchange(4, gpus_per_node=6, nodes=2).all_to_all == pytest.approx(HANDED * 2 / 4 / 10e9 + 0.004)
    from zerodp.plan.cluster import sequence_group_peers

    assert sequence_group_peers(4, 6, 12) == {(3, 0), (1, 2)}
    assert sequence_group_peers(8, 4, 8) == {(3, 4)}


def test_the_all_to_all_is_no_longer_priced_as_a_ring_over_every_rank() -> None:
    """S = 2 on 2 nodes of 8: the old price was (16-1)/16 of the bytes at the inter-node bandwidth, 0.754 s."""
    ring_over_all_ranks = HANDED * 15 / 16 / 10e9 + CALLS * 0.001
    t = _exchange(2, gpus_per_node=8, nodes=2)
    assert t.communication == pytest.approx(0.044) and t.communication < ring_over_all_ranks / 10
    # ZeRO's collectives beside it stay rings over all ranks, and only they hide behind compute
    cluster = Cluster(gpus_per_node=8, nodes=2, peak_flops=1e12, efficiency=1.0, micro_batch_overhead=0.0,
                      overlap=0.5, **LINKS)
    work = Work(1e12, 1, {"all_to_all": HANDED, "all_gather": 1e9}, {"all_to_all": CALLS, "all_gather": 2}, 0, 0, 0,
                sequence_parallel=2)
    t = step_time(work, cluster)
    ring = 1e9 * 15 / 16 / 10e9 + 2 * 0.001
    assert t.communication == pytest.approx(ring + 0.044) and t.all_to_all == pytest.approx(0.044)
    assert t.exposed_communication == pytest.approx(ring * 0.5 + 0.044)
    assert t.as_dict()["all_to_all"] == t.all_to_all  # --json's step_seconds
    # without sequence parallelism an all_to_all (none the plan runs today) is priced as before
    plain = step_time(replace(work, sequence_parallel=1), cluster)
    assert plain.all_to_all == 0 and plain.communication == pytest.approx(ring + ring_over_all_ranks)


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


def test_plan_prices_the_stage_3_candidates_with_zero_plus_plus_s_quantized_bytes(tmp_path, capsys) -> None:
    """--zero-quantized-weights/--zero-quantized-gradients: the stage-3 candidates are simulated with the keys,
    so their collectives are the runtime's int8 blocks and fp32 scales; the written config carries them."""
    from zerodp.config import load_config
    from zerodp.plan.cluster import gpu_cluster
    from zerodp.plan.planner import plan
    from zerodp.plan.workload import workload
    from zerodp.plan.zeropp import ZeroPlusPlus

    # d_model 256: matrices above the persistence threshold (1e5 elements), so stage 3 gathers them per pass
    work, cluster = workload("gpt:d_model=256,n_layer=2,seq_len=32"), gpu_cluster("cpu", gpus_per_node=2,
                                                                                  gpu_memory_bytes=10**9)

    def stage_3(zeropp: ZeroPlusPlus):
        found = plan(work, cluster, 32, 16, "fp32", ("none",), exhaustive=True, zeropp=zeropp).candidates
        return next(c for c in found if c.strategy == StrategySpec(3, dtype="fp32")), \
            next(c for c in found if c.strategy.stage == 2)

    (plain, _), (quantized, below) = stage_3(ZeroPlusPlus()), stage_3(ZeroPlusPlus(True, True))
    assert quantized.describe() == "stage 3, qwZ + qgZ" and below.zeropp == ""
    # 1 byte and 4/256 of a scale for 4 (the persistent norms' fp32 all-gather after the step stays): measured
    # 18,604,048 -> 5,209,600 bytes a step
    assert plain.comm_bytes * 0.25 < quantized.comm_bytes < plain.comm_bytes * 0.3
    assert quantized.time.communication < plain.time.communication
    config = load_config(quantized.ds_config(16), world_size=2)
    assert config.zero_optimization.zero_quantized_weights and config.zero_optimization.zero_quantized_gradients
    assert main(["plan", "demo", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "32", "--global-batch", "16",
                 "--zero-quantized-weights", "--sequence-parallel", "2"]) == 2
    assert "--zero-quantized-weights/--zero-quantized-gradients with --sequence-parallel 2" in capsys.readouterr().err


def test_the_flop_count_of_a_checkpointed_hugging_face_model_runs_on_meta(tmp_path) -> None:
    """Checkpointing turns the key/value cache off, and transformers then reads the position ids' values
    to find packed documents, which a meta tensor has none of: `unpacked_rows` answers for them. The
    recompute adds one forward: about 4/3 of the FLOPs."""
    transformers = pytest.importorskip("transformers")
    from zerodp.plan.planner import count_flops
    from zerodp.plan.workload import workload

    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    work = workload(str(tmp_path))
    plain, checkpointed = (count_flops(work, 2, 64, policy) for policy in ("none", "blocks"))
    assert plain < checkpointed < 1.4 * plain
