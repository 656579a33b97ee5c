"""Hierarchical partitioning at stage 3: ZeRO++ hpZ (zero_hpz_partition_size) and MiCS (mics_shard_size).

4 ranks as 2 nodes of 2 (GROUP_RANK, as torchrun sets it), so the comm ledger tells the intra-node
link from the inter-node one. Against flat stage 3 on the same 4 ranks: hpZ gathers the same values
from other ranks and reduces in the same order, so it is bitwise equal; MiCS sums gradients in
another order (inside the node, then across), so it agrees to rounding. Bytes are asserted exactly
from zerodp/zero/topology.py's [Note: hierarchical partitioning] (docs/multinode.md has the formulas).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.harness import full_state, run_ranks
from tests.test_stage3 import LOOSE, _adamw, _config, _ddp, _unit_numels, _zerodp

STEPS, GAS = 3, 2
FLAT, HPZ, MICS = {}, {"zero_hpz_partition_size": 2}, {"mics_shard_size": 2}
MICS_OFFLOAD = {**MICS, "offload_optimizer": {"device": "cpu"}}  # gradient shards on the host


def _always(step: int, micro: int) -> bool:
    return True


def _train(rank: int, world: int, zero: dict) -> dict:
    os.environ["GROUP_RANK"] = str(rank // 2)  # ranks 0-1 on node 0, 2-3 on node 1
    losses, params, engine = _zerodp(rank, STEPS, GAS, _config(GAS, LOOSE, **zero), _adamw, {"reuse_first": False},
                                     use_last=_always)
    ref_losses, ref_params = _ddp(rank, STEPS, GAS, LOOSE, _adamw, {"reuse_first": False}, use_last=_always)
    comm = engine.comm_report()["last_step"]["ops"]
    return {"losses": losses, "params": params, "ref_losses": ref_losses, "ref_params": ref_params,
            "held": engine.memory_report()["held"], "state": full_state(engine),
            "bytes": {op: comm[op]["link_bytes"] for op in ("all_gather[float32]", "reduce_scatter[float32]",
                                                           "all_reduce[float32]") if op in comm}}


@pytest.fixture(scope="module")
def runs() -> dict:
    return {name: run_ranks(_train, 4, args=(zero,))
            for name, zero in (("flat", FLAT), ("hpz", HPZ), ("mics", MICS), ("mics_offload", MICS_OFFLOAD))}


def test_hpz_is_bitwise_flat_stage_3_and_mics_agrees_to_rounding_and_both_match_ddp(runs: dict) -> None:
    for rank in range(4):
        flat, hpz, mics = (runs[name][rank] for name in ("flat", "hpz", "mics"))
        assert hpz["losses"] == flat["losses"]
        assert hpz["params"].keys() == mics["params"].keys() == flat["params"].keys()
        assert all(torch.equal(hpz["params"][n], t) for n, t in flat["params"].items())
        assert mics["losses"] == pytest.approx(flat["losses"], rel=1e-6)
        assert runs["mics_offload"][rank]["losses"] == pytest.approx(mics["losses"], rel=1e-6)
        for n, t in flat["params"].items():
            torch.testing.assert_close(mics["params"][n], t, rtol=1e-5, atol=1e-6)
        for run in (flat, hpz, mics):
            assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-5)
            for n, t in run["ref_params"].items() if rank == 0 else ():  # the full weights are rank 0's
                torch.testing.assert_close(run["params"][n], t, rtol=1e-4, atol=1e-5)
    for name in ("hpz", "mics"):  # the optimizer state too: every element once, as the flat run's
        for n, tensors in runs["flat"][0]["state"].items():
            for key, t in tensors.items():
                torch.testing.assert_close(runs[name][0]["state"][n][key], t, rtol=1e-4, atol=1e-6)


def test_each_link_carries_the_bytes_of_the_formulas(runs: dict) -> None:
    """fp32 (4 bytes), per optimizer step of 2 micro-batches. R = the root unit (gathered from forward
    to the end of backward: one gather per micro-batch), B = the 4 blocks (a gather in forward and one
    in backward); a reduce-scatter per unit and micro-batch; the 2-element norm all-reduce (counted 2x)."""
    numels = _unit_numels(4)  # padded to 4 ranks; the same padded to 2 (544 and 1104 are multiples of 4)
    assert numels == _unit_numels(2)
    R, B = numels["<root>"][1], sum(p for n, (_, p) in numels.items() if n != "<root>")
    f32 = 4
    for rank in range(4):
        flat, hpz, mics = (runs[name][rank]["bytes"] for name in ("flat", "hpz", "mics"))
        # flat: every collective spans both nodes
        assert flat == {"all_gather[float32]": {"inter_node": f32 * GAS * (R + 2 * B)},
                        "reduce_scatter[float32]": {"inter_node": f32 * GAS * (R + B)},
                        "all_reduce[float32]": {"inter_node": f32 * 4}}
        # hpZ: only the step's first forward gathers over all ranks (the step changed the shards); every
        # later gather of the step reads the secondary shards inside the node
        assert hpz == {"all_gather[float32]": {"inter_node": f32 * (R + B), "intra_node": f32 * (R + 3 * B)},
                       "reduce_scatter[float32]": {"inter_node": f32 * GAS * (R + B)},
                       "all_reduce[float32]": {"inter_node": f32 * 4}}
        # MiCS: gathers and reduce-scatters inside the node; across nodes, once per step, the all-reduce of
        # each unit's accumulated gradient shard (half a unit, counted 2x) and nothing else
        assert mics == {"all_gather[float32]": {"intra_node": f32 * GAS * (R + 2 * B)},
                        "reduce_scatter[float32]": {"intra_node": f32 * GAS * (R + B)},
                        "all_reduce[float32]": {"inter_node": f32 * (R + B), "intra_node": f32 * 4}}
        # optimizer offloaded: the same here, where the host is the device (on CUDA, where NCCL cannot
        # reduce the host's gradient shards, each micro-batch's shard is all-reduced on the GPU instead)
        assert runs["mics_offload"][rank]["bytes"] == mics


def test_the_ledger_holds_a_quarter_flat_a_half_mics_and_hpz_adds_the_secondary_half(runs: dict) -> None:
    numels = _unit_numels(4)
    padded = sum(p for _, p in numels.values())
    for rank in range(4):
        flat, hpz, mics = (runs[name][rank]["held"] for name in ("flat", "hpz", "mics"))
        assert flat["param32_master"]["device"] == hpz["param32_master"]["device"] == 4 * padded // 4
        assert mics["param32_master"]["device"] == 4 * padded // 2
        assert hpz["param_secondary"]["device"] == 4 * padded // 2  # 1/2 of every unit, beside the 1/4 shard
        assert "param_secondary" not in flat and "param_secondary" not in mics
        assert mics["grad"]["device"] == 2 * flat["grad"]["device"] == hpz["grad"]["device"] * 2


def _save_then_load(rank: int, world: int, ckpt: str, save_zero: dict, load_zero: dict):
    os.environ["GROUP_RANK"] = str(rank // 2)
    _, _, engine = _zerodp(rank, 2, GAS, _config(GAS, LOOSE, **save_zero), _adamw, {"reuse_first": False},
                           use_last=_always)
    engine.save_checkpoint(ckpt)
    saved = full_state(engine)
    _, _, fresh = _zerodp(rank, 0, GAS, _config(GAS, LOOSE, **load_zero), _adamw, {"reuse_first": False})
    fresh.load_checkpoint(ckpt)
    return saved, full_state(fresh)


@pytest.mark.parametrize("save_zero,load_zero", [(MICS, FLAT), (FLAT, MICS), (MICS, HPZ)])
def test_checkpoints_move_between_flat_mics_and_hpz_exactly(tmp_path: Path, save_zero: dict, load_zero: dict) -> None:
    for saved, loaded in run_ranks(_save_then_load, 4, args=(str(tmp_path), save_zero, load_zero)):
        assert saved.keys() == loaded.keys()
        for n, tensors in saved.items():
            for key, t in tensors.items():
                assert torch.equal(loaded[n][key], t), (n, key)


class _Blocks(torch.nn.Module):
    """Only repeated blocks: every parameter in a unit released between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.square().mean()


def _link_bytes_of_blocks(rank: int, world: int, zero: dict) -> dict:
    import zerodp

    os.environ["GROUP_RANK"] = str(rank // 2)
    engine, *_ = zerodp.initialize(model=_Blocks(), config=_config(GAS, LOOSE, **zero), optimizer=_adamw)
    for step in range(2):
        for micro in range(GAS):
            engine.backward(engine(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + micro))))
            engine.step()
    links: dict[str, int] = {}  # of the float32 collectives (gloo's int64 unit checks before each gather aside)
    for op, record in engine.comm_report()["last_step"]["ops"].items():
        for link, n in record["link_bytes"].items():
            if op.endswith("[float32]"):
                links[link] = links.get(link, 0) + n
    return links


@pytest.mark.parametrize("mode", ["flat", "hpz", "mics"])
def test_the_link_formulas_the_planner_uses_are_the_ledger(mode: str) -> None:
    from zerodp.zero.topology import stage3_link_numel

    numel = 4 * (16 * 16 + 16)  # padded to 4 ranks: already a multiple
    expected = stage3_link_numel(mode, numel, group_size=2, micro_batches=GAS)
    norm = 4 * 2 * 2  # the gradient-norm all-reduce: 2 fp32 elements, counted twice; in the shard group
    expected[{"mics": "intra_node"}.get(mode, "inter_node")] += norm // 4
    for link_bytes in run_ranks(_link_bytes_of_blocks, 4, args=({"flat": FLAT, "hpz": HPZ, "mics": MICS}[mode],)):
        assert link_bytes == {link: 4 * n for link, n in expected.items() if n}
