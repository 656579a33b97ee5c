"""Offload to host memory (ZeRO-Offload): the same numbers as without offload, and the ledger
shows the move (zerodp.offload.cpu's [Note: CPU offload])."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.models import batch, make_block_lm, two_groups

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train(rank: int, world: int, stage: int, offload: dict, precision: dict, gas: int = 2):
    import zerodp

    model = make_block_lm()
    zero = {"stage": stage, **offload}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
              "zero_optimization": zero, **precision}
    engine, *_ = zerodp.initialize(model=model, model_parameters=two_groups(model), config=config,
                                   optimizer=lambda g: torch.optim.AdamW(g, **ADAMW))
    losses = []
    for step in range(4):
        for micro in range(gas):
            loss = engine(*batch(rank, step, micro), use_last=micro != 1)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, engine.module.state_dict(), engine.memory_report(), type(engine.optimizer).__name__


CPU = {"offload_optimizer": {"device": "cpu"}}
CPU_PARAMS = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def _pair(rank: int, world: int, stage: int, offload: dict, precision: dict):
    plain = _train(rank, world, stage, {}, precision)
    moved = _train(rank, world, stage, offload, precision)
    same_params = rank != 0 or all(torch.equal(plain[1][n], moved[1][n]) for n in plain[1])
    return plain[0] == moved[0], same_params, plain[2], moved[2]


@pytest.mark.parametrize("stage,offload", [(1, CPU), (2, CPU), (3, CPU), (3, CPU_PARAMS)])
@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_offloaded_training_is_bitwise_the_same(stage: int, offload: dict, precision: dict) -> None:
    """The same fp32 operations on the same values, wherever they live: bitwise, in fp32 and bf16."""
    for same_losses, same_params, _, _ in run_ranks(_pair, 2, args=(stage, offload, precision)):
        assert same_losses and same_params


@pytest.mark.parametrize("stage,offload", [(1, CPU), (2, CPU), (3, CPU), (3, CPU_PARAMS)])
def test_the_ledger_moves_optimizer_state_and_params_off_the_device_exactly(stage: int, offload: dict) -> None:
    """bf16: the device keeps no fp32 master, no optimizer state and (stages 2-3) no gradient shard;
    with offload_param no parameter shard either. Every byte moved shows up in the cpu tier."""
    for _, _, plain, moved in run_ranks(_pair, 2, args=(stage, offload, {"bf16": {"enabled": True}})):
        before, after = plain["held"], moved["held"]
        assert "device" not in after["param32_master"] and "device" not in after["optim_state"]
        assert after["param32_master"]["cpu"] == before["param32_master"]["device"]
        assert after["optim_state"]["cpu"] == before["optim_state"]["device"]
        grad_tier = "device" if stage == 1 else "cpu"  # stage 1 keeps its full-size gradient buffer
        assert after["grad"] == {grad_tier: before["grad"]["device"]}
        param_tier = "cpu" if "offload_param" in offload else "device"
        assert after["param16"] == {param_tier: before["param16"]["device"]}
        assert moved["model_states"] == plain["model_states"]


def _fp32_master_is_separate(rank: int, world: int):
    losses, _, memory, optimizer = _train(rank, world, 2, CPU, {}, gas=1)
    return memory["held"], optimizer


def test_fp32_offload_keeps_a_host_master_and_the_params_on_the_device() -> None:
    """In fp32 the parameter is its own master on the device; offloaded, the master is a host copy."""
    (held, optimizer), _ = run_ranks(_fp32_master_is_separate, 2)
    assert optimizer == "AdamW"
    assert set(held["param32_master"]) == {"device", "cpu"}
    assert held["optim_state"].keys() == {"cpu"}
