"""`zerodp estimate` with ZeRO++ (--zero-quantized-weights, --zero-quantized-gradients, --zero-hpz-partition-size):
the estimate equals the runtime's ledgers byte for byte (zerodp/plan/zeropp.py's [Note: ZeRO++ in the estimate]).

A tiny Hugging Face Llama whose MLP weights (64 x 2048 = 131,072 elements) are above DeepSpeed's default
persistence threshold (1e5), so at stage 3 they are gathered per unit, and quantized with qwZ; the rest stays in
the persistent unit, gathered exactly. Real runs: 2 ranks on gloo (and 4 ranks as 2 nodes for hpZ's links),
bf16, 2 optimizer steps; the simulated rank's row must hold the same step ledger (per op and dtype: calls,
elements, bytes, bytes by link: the int8 payloads apart from the fp32 scales) and the same memory ledger.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import run_ranks
from zerodp.cli import main
from zerodp.plan.model_states import StrategySpec
from zerodp.plan.zeropp import ZeroPlusPlus

pytest.importorskip("transformers")

LLAMA = dict(vocab_size=64, hidden_size=64, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
MICRO, SEQ = 1, 16
STAGE3 = StrategySpec(3, dtype="bf16")
CASES = {"flat": ZeroPlusPlus(), "qwZ": ZeroPlusPlus(True), "qgZ": ZeroPlusPlus(False, True),
         "qwZ + qgZ": ZeroPlusPlus(True, True), "qwZ + qgZ + hpZ 2": ZeroPlusPlus(True, True, 2)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama_zeropp")
    LlamaConfig(**LLAMA).save_pretrained(path)
    return str(path)


def _real(rank: int, world: int, spec: str, names: list[str], nodes: bool) -> dict:
    """Each case in turn on these ranks (`nodes`: 2 ranks per node, as torchrun's GROUP_RANK says): stage 3,
    bf16, 2 steps; the last step's comm ledger and the memory ledger."""
    import torch

    import zerodp
    from zerodp.plan.model_states import strategy_config
    from zerodp.plan.simulate import train_steps
    from zerodp.plan.workload import workload

    if nodes:
        os.environ["GROUP_RANK"] = str(rank // 2)
    work, out = workload(spec), {}
    for name in names:
        torch.manual_seed(rank)
        config = strategy_config(STAGE3, MICRO)
        config["zero_optimization"].update(CASES[name].zero_keys(STAGE3))
        engine, *_ = zerodp.initialize(model=work.build(), config=config)
        train_steps(engine, lambda m, dev: work.inputs(m, MICRO, SEQ, dev), 2)
        held = engine.memory_report()["held"]
        ops = engine.comm_report()["last_step"]["ops"]
        # less zero/pairing.py's int64 checks that every rank gathers the same unit (16 bytes a gather on gloo;
        # one all-reduce a forward on NCCL), which compare ranks' values: a simulated rank skips them
        out[name] = {"ops": {op: rec for op, rec in ops.items() if not op.endswith("[int64]")},
                     "held": {f"{c} ({t})": b for c, tiers in held.items() for t, b in tiers.items() if b}}
    return out


def _stage3_row(spec: str, world: int, zeropp: ZeroPlusPlus, monkeypatch) -> dict:
    """The estimate's stage-3 row (no offload), simulating that strategy only (the others take seconds each)."""
    import zerodp.plan.estimate as estimate
    from zerodp.plan.workload import workload

    monkeypatch.setattr(estimate, "every_strategy", lambda dtype: [STAGE3])
    work = workload(spec)
    module = work.meta()
    numel = sum(p.numel() for p in module.parameters())
    (row,) = estimate.estimate_rows(numel, world, "bf16", module=module, work=work, micro_batch=MICRO, seq_len=SEQ,
                                    zeropp=zeropp)
    return row


def test_the_estimate_is_the_runtime_ledger_for_qwz_qgz_both_and_hpz_on_2_ranks(llama, monkeypatch) -> None:
    real = run_ranks(_real, 2, args=(llama, list(CASES), False))
    for name, zeropp in CASES.items():
        row = _stage3_row(llama, 2, zeropp, monkeypatch)
        assert row["zeropp"] == zeropp.zero_keys(STAGE3)
        for rank, runs in enumerate(real):
            assert row["comm_ops"] == runs[name]["ops"], (name, rank)
        assert row["by_category"] == real[0][name]["held"], name  # rank 0's: padding sits on the last rank
    ops = {name: real[0][name]["ops"] for name in CASES}
    # qwZ: the units' gathers go as int8 (1 byte per bf16 element, plus 4 bytes per block of 256), the
    # persistent unit's gather after the step stays exact; qgZ: the reduce-scatter becomes all-to-alls
    unit_gathered = ops["flat"]["all_gather[bfloat16]"]["numel"] - ops["qwZ"]["all_gather[bfloat16]"]["numel"]
    assert ops["qwZ"]["all_gather[int8]"]["bytes"] == unit_gathered
    assert ops["qgZ"]["all_to_all[int8]"]["bytes"] == ops["flat"]["reduce_scatter[bfloat16]"]["numel"]
    assert "reduce_scatter[bfloat16]" not in ops["qgZ"] and "all_gather[int8]" not in ops["qgZ"]
    assert real[0]["qwZ + qgZ + hpZ 2"]["held"]["param_secondary (device)"] > 0


def test_hpz_bytes_by_link_on_4_ranks_as_2_nodes(llama, monkeypatch) -> None:
    """hpZ 2 with 4 ranks as 2 nodes of 2: the first forward's gathers cross the nodes, later ones stay inside."""
    name = "qwZ + qgZ + hpZ 2"
    real = run_ranks(_real, 4, args=(llama, [name], True))
    row = _stage3_row(llama, 4, CASES[name], monkeypatch)
    for rank, runs in enumerate(real):
        assert row["comm_ops"] == runs[name]["ops"], rank
    links = row["comm_ops"]["all_gather[int8]"]["link_bytes"]
    assert links["inter_node"] > 0 and links["intra_node"] > 0
    assert row["by_category"] == real[0][name]["held"]
    # the preflight (zerodp/plan/preflight.py) counts the secondary copy from the run's own config too
    from zerodp.config import load_config
    from zerodp.plan.model_states import strategy_config
    from zerodp.plan.preflight import device_bytes, strategy_of
    from zerodp.plan.workload import workload

    config = strategy_config(STAGE3, MICRO)
    config["zero_optimization"].update(CASES[name].zero_keys(STAGE3))
    config = load_config(config, world_size=4)
    module = workload(llama).meta()
    assert device_bytes(config, module, set(module.parameters()), 4, strategy_of(config)) == row["model_states_bytes"]


def test_the_flags_reach_the_rows_and_the_runtime_s_refusals_are_kept(llama, capsys) -> None:
    """Model states: hpZ adds param_secondary at stage 3 only, leaves out the rows that offload parameters (hpZ
    refuses them); an S that does not divide the ranks, and ZeRO++ with sequence parallelism, are refused naming
    the flags."""
    def rows(*flags: str) -> dict:
        assert main(["estimate", llama, "--world-size", "4", "--model-states-only", "--json", *flags]) == 0
        return {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in json.loads(capsys.readouterr().out)}

    plain, hpz = rows(), rows("--zero-quantized-weights", "--zero-hpz-partition-size", "2")
    assert set(plain) - set(hpz) == {k for k in plain if k[0] == 3 and k[2] != "none"}
    for key, row in hpz.items():
        extra = row["by_category"].pop("param_secondary (device)", 0)
        assert row["by_category"] == plain[key]["by_category"], key
        assert (extra > 0) == (key[0] == 3), key
        assert row["zeropp"] == ({"zero_quantized_weights": True, "zero_hpz_partition_size": 2} if key[0] == 3 else {})
    assert main(["estimate", llama, "--world-size", "4", "--zero-hpz-partition-size", "3"]) == 2
    assert "--zero-hpz-partition-size 3 does not divide --world-size 4" in capsys.readouterr().err
    assert main(["estimate", llama, "--world-size", "4", "--sequence-parallel", "2", "--zero-quantized-gradients"]) == 2
    assert "with --sequence-parallel 2: the runtime does not build ZeRO++ with sequence parallelism" in \
        capsys.readouterr().err
