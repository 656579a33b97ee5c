"""ZeRO++ quantized collectives at stage 3: qwZ (`zero_quantized_weights`) and qgZ (`zero_quantized_gradients`),
alone and with hpZ.

tests/models.py's BlockLM as in test_stage3.py: a root unit of 544 elements and 4 blocks of 1104, padded to
the world size. Bytes are asserted exactly from the ledger: an int8 payload of one byte per padded element
plus one fp32 scale per block of quantize.BLOCK_NUMEL elements of each rank's piece (zero/quantize.py's
[Note: block quantization]); the values gathered are exactly the dequantized blocks, within half a step of
the exact ones.
"""

from __future__ import annotations

import logging

import os
from pathlib import Path

import pytest
import torch

from tests.harness import full_state, run_ranks
from tests.test_stage3 import LOOSE, _adamw, _always, _config, _ledgers, _unit_numels, _zerodp
from zerodp.config import ConfigError, load_config
from zerodp.zero import quantize
from zerodp.zero.quantize import BLOCK_NUMEL, dequantize, dequantize_rows, error_bound, num_blocks, quantize_rows

QW, QG = {"zero_quantized_weights": True}, {"zero_quantized_gradients": True}
BF16 = {"bf16": {"enabled": True}}


# --- the kernels --------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [64, 256, 2048])
def test_each_element_is_within_half_a_step_of_its_block_and_bytes_are_payload_plus_scales(block: int) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 3000)
    q, scales = quantize.quantize(x, block)
    assert q.dtype == torch.int8 and q.numel() == 3000 and scales.numel() == num_blocks(3000, block)
    assert int(q.abs().max()) == 127  # every block's largest element maps to +-127
    error = (x - dequantize(q, scales, block)).abs()
    assert bool((error <= error_bound(scales, 3000, block) * (1 + 2**-20)).all())
    assert quantize.quantized_bytes(3000, block) == 3000 + 4 * -(-3000 // block)


def test_zero_blocks_are_exact_and_a_non_finite_element_poisons_its_block() -> None:
    x = torch.zeros(300)
    x[260] = float("inf")
    q, scales = quantize.quantize(x, 256)
    values = dequantize(q, scales, 256)
    assert bool((values[:256] == 0).all()) and not bool(values[256:].isfinite().any())


# --- bytes per step from the ledger (2 ranks, one node) ----------------------------------------------

def _scales(numel: int, ranks: int) -> int:
    """fp32 scales of one quantized collective of a buffer of `numel` padded elements over `ranks`: one
    per block of each rank's piece, from every rank."""
    return ranks * num_blocks(numel // ranks, BLOCK_NUMEL)


@pytest.mark.parametrize("precision,dtype,width", [({}, "float32", 4), (BF16, "bfloat16", 2)])
def test_all_gather_and_reduce_bytes_per_step_flat_vs_qwz_vs_qgz(precision: dict, dtype: str, width: int) -> None:
    """One step of one micro-batch at 2 ranks: each block gathered in forward and in backward, the root once;
    each unit reduced once. Flat sends `width` bytes per padded element; quantized 1 byte plus the scales."""
    numels = _unit_numels(2)
    root, blocks = numels["<root>"][1], [p for n, (_, p) in numels.items() if n != "<root>"]
    gathered, reduced = root + 2 * sum(blocks), root + sum(blocks)
    gather_scales = _scales(root, 2) + 2 * sum(_scales(b, 2) for b in blocks)
    reduce_scales = _scales(root, 2) + sum(_scales(b, 2) for b in blocks)
    runs = {name: run_ranks(_ledgers, 2, args=(precision, zero))
            for name, zero in (("flat", {}), ("qwz", QW), ("qgz", QG), ("both", {**QW, **QG}))}
    accum = "float32" if precision == {} else dtype  # the gradient buffer's dtype (grad_accum_dtype)
    for rank in range(2):
        ops = {name: run[rank][1]["ops"] for name, run in runs.items()}
        assert ops["flat"][f"all_gather[{dtype}]"]["bytes"] == width * gathered
        assert ops["flat"][f"reduce_scatter[{accum}]"]["bytes"] == width * reduced
        for name in ("qwz", "both"):
            assert ops[name]["all_gather[int8]"]["bytes"] == gathered
            # only the scales travel in fp32 (an fp32 model's weights too go as int8); nothing in bf16
            assert ops[name]["all_gather[float32]"]["bytes"] == 4 * gather_scales
            assert "all_gather[bfloat16]" not in ops[name]
        for name in ("qgz", "both"):
            assert ops[name]["all_to_all[int8]"]["bytes"] == reduced
            assert ops[name]["all_to_all[float32]"]["bytes"] == 4 * reduce_scales
            assert f"reduce_scatter[{accum}]" not in ops[name]
        assert "all_gather[int8]" not in ops["qgz"] and "all_to_all[int8]" not in ops["qwz"]
        flat_bytes = ops["flat"][f"all_gather[{dtype}]"]["bytes"]
        qwz_bytes = ops["qwz"]["all_gather[int8]"]["bytes"] + ops["qwz"]["all_gather[float32]"]["bytes"]
        assert flat_bytes / qwz_bytes == pytest.approx(width * gathered / (gathered + 4 * gather_scales))


# --- hpZ: 4 ranks as 2 nodes ------------------------------------------------------------------------

STEPS, GAS = 3, 2


def _train_nodes(rank: int, world: int, zero: dict) -> dict:
    os.environ["GROUP_RANK"] = str(rank // 2)  # ranks 0-1 on node 0, 2-3 on node 1
    losses, _, engine = _zerodp(rank, STEPS, GAS, _config(GAS, LOOSE, **zero), _adamw, {"reuse_first": False},
                                use_last=_always)
    ops = engine.comm_report()["last_step"]["ops"]
    return {"losses": losses, "bytes": {op: rec["link_bytes"] for op, rec in ops.items() if "int64" not in op}}


def test_hpz_with_qwz_and_qgz_quantizes_the_primary_and_the_secondary_gathers() -> None:
    """As DeepSpeed 0.19.8 (zero/quantized_comm.py's [Note: quantized collectives]): per step of 2
    micro-batches, the first forward gathers R + B over the 4 ranks (inter-node), every later gather
    (R + 3B) comes from the secondary copies inside the node; both quantized, and so is every reduce."""
    numels = _unit_numels(4)
    R, blocks = numels["<root>"][1], [p for n, (_, p) in numels.items() if n != "<root>"]
    B = sum(blocks)
    primary_scales = _scales(R, 4) + sum(_scales(b, 4) for b in blocks)
    secondary_scales = _scales(R, 2) + 3 * sum(_scales(b, 2) for b in blocks)
    runs = {name: run_ranks(_train_nodes, 4, args=(zero,))
            for name, zero in (("hpz", {"zero_hpz_partition_size": 2}),
                               ("all", {"zero_hpz_partition_size": 2, **QW, **QG}))}
    for rank in range(4):
        hpz, quantized = runs["hpz"][rank], runs["all"][rank]
        assert hpz["bytes"]["all_gather[float32]"] == {"inter_node": 4 * (R + B), "intra_node": 4 * (R + 3 * B)}
        assert quantized["bytes"] == {
            "all_gather[int8]": {"inter_node": R + B, "intra_node": R + 3 * B},
            "all_gather[float32]": {"inter_node": 4 * primary_scales, "intra_node": 4 * secondary_scales},
            "all_to_all[int8]": {"inter_node": GAS * (R + B)},
            "all_to_all[float32]": {"inter_node": 4 * GAS * (_scales(R, 4) + sum(_scales(b, 4) for b in blocks))},
            "all_reduce[float32]": {"inter_node": 4 * 4}}
        assert quantized["losses"] == pytest.approx(hpz["losses"], rel=2e-2)


# --- values --------------------------------------------------------------------------------------------

def _gathered(rank: int, world: int, precision: dict) -> dict:
    """A block unit gathered quantized (as forward does) and exactly, and the first losses."""
    losses, _, engine = _zerodp(rank, 2, 1, {**_config(**QW), **precision}, _adamw, {"reuse_first": False},
                                use_last=_always)
    flat_losses, _, _ = _zerodp(rank, 2, 1, {**_config(), **precision}, _adamw, {"reuse_first": False},
                                use_last=_always)
    import zerodp

    unit = engine.strategy.units[1]
    unit.gather()  # as the forward and backward hooks do
    quantized = unit.trainable.full.clone()
    unit.release()
    with zerodp.zero.GatheredParameters(list(unit.module.parameters())):  # never quantized
        exact = unit.trainable.full.clone()
    return {"quantized": quantized, "exact": exact, "shard": unit.trainable.shard.clone(),
            "owned": unit.trainable.owned, "losses": losses, "flat_losses": flat_losses}


@pytest.mark.parametrize("precision,unit_roundoff", [({}, 2.0**-24), (BF16, 2.0**-8)])
def test_the_gathered_buffer_is_exactly_each_rank_s_dequantized_blocks_within_half_a_step(
        precision: dict, unit_roundoff: float) -> None:
    """Rank r's piece of the gathered buffer is deq(q(shard_r)) cast to the working dtype, bit for bit, and
    |w - deq(q(w))| <= s/2 plus the rounding of the cast (a relative `unit_roundoff`) per element;
    GatheredParameters gathers the exact values."""
    for result in run_ranks(_gathered, 2, args=(precision,)):
        exact, quantized = result["exact"], result["quantized"]
        assert torch.equal(exact[result["owned"]], result["shard"])  # GatheredParameters: the values held
        q, scales = quantize_rows(exact.view(2, -1), BLOCK_NUMEL)
        expected = dequantize_rows(q, scales, BLOCK_NUMEL).reshape(-1)
        assert torch.equal(quantized, expected.to(exact.dtype))
        assert not torch.equal(quantized, exact)
        bound = torch.cat([error_bound(s, exact.numel() // 2, BLOCK_NUMEL) for s in scales])
        error = (exact.float() - quantized.float()).abs()
        assert bool((error <= bound * (1 + 2**-20) + unit_roundoff * quantized.float().abs()).all())
        assert result["losses"][0] == pytest.approx(result["flat_losses"][0], rel=1e-2)  # a sanity check only


def _train_save_load(rank: int, world: int, ckpt: str) -> tuple:
    losses, _, engine = _zerodp(rank, 3, 2, _config(2, LOOSE, **QW, **QG), _adamw, {"reuse_first": False},
                                use_last=_always)
    flat_losses, _, _ = _zerodp(rank, 3, 2, _config(2, LOOSE), _adamw, {"reuse_first": False}, use_last=_always)
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    offload_losses, _, _ = _zerodp(rank, 3, 2, _config(2, LOOSE, **QW, **QG, **offload), _adamw,
                                   {"reuse_first": False}, use_last=_always)
    engine.save_checkpoint(ckpt)
    saved = full_state(engine)
    _, _, fresh = _zerodp(rank, 0, 2, _config(2, LOOSE), _adamw, {"reuse_first": False})
    fresh.load_checkpoint(ckpt)
    masters = [u.master.clone() for u in engine.strategy.units if u.master is not None]
    return losses, flat_losses, offload_losses, saved, full_state(fresh), masters


def test_training_stays_close_to_flat_offloaded_too_and_checkpoints_keep_full_precision_masters(
        tmp_path: Path) -> None:
    """qwZ + qgZ for 3 steps of 2 micro-batches; with offload_param the host's shard is copied to the gather's
    device and quantized there (here the same CPU: bitwise the same run); a checkpoint loads into a flat
    (unquantized) engine exactly, and its masters are fp32 values, not an int8 grid."""
    runs = run_ranks(_train_save_load, 2, args=(str(tmp_path),))
    for losses, flat_losses, offload_losses, saved, loaded, masters in runs:
        assert losses == pytest.approx(flat_losses, rel=1e-2) and losses != flat_losses
        assert offload_losses == losses
        assert saved.keys() == loaded.keys()
        for n, tensors in saved.items():
            for key, t in tensors.items():
                assert torch.equal(loaded[n][key], t), (n, key)
        for master in masters:  # fp32 values, not a dequantized int8 grid
            assert master.dtype == torch.float32
            q, scales = quantize.quantize(master, BLOCK_NUMEL)
            assert not torch.equal(dequantize(q, scales, BLOCK_NUMEL), master)


# --- refusals, before any rank communicates -----------------------------------------------------------

@pytest.mark.parametrize("stage,keys", [(2, QW), (1, QG), (0, {**QW, **QG})])
def test_below_stage_3_the_keys_are_ignored_with_one_warning_as_deepspeed_ignores_them(
        stage: int, keys: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import zerodp.log

    monkeypatch.setattr(zerodp.log, "_warned", set())
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": stage, **keys}}, world_size=4)
    assert cfg.zero_optimization.stage == stage
    said = [r.getMessage() for r in caplog.records if "is ignored, as DeepSpeed ignores it" in r.getMessage()]
    assert sorted(said) == sorted(f"zero_optimization.{key}: true quantizes the collectives of ZeRO stage 3; at "
                                  f"zero_optimization.stage {stage} it is ignored, as DeepSpeed ignores it (set the "
                                  "stage to 3 to use it)" for key in keys)


@pytest.mark.parametrize("zero,message", [
    ({"stage": 3, "mics_shard_size": 2, **QW}, r"zero_quantized_weights with zero_optimization.mics_shard_size 2"),
    ({"stage": 3, "zero_quantized_nontrainable_weights": True},
     r"zero_quantized_nontrainable_weights: true is not supported by zerodp \(storing frozen weights quantized"),
])
def test_combinations_not_built_are_refused_naming_the_key(zero: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=4)


def test_quantized_gradients_with_sequence_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"zero_quantized_gradients with sequence_parallel_size 2"):
        load_config({"train_batch_size": 8, "sequence_parallel_size": 2, "zero_optimization": {"stage": 3, **QG}},
                     world_size=4)
