"""Engine behaviour on gloo ranks: accumulation boundaries, overflow skipping, the ledgers, errors."""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankFailed, run_ranks
from tests.models import batch, make_model


def _engine(config: dict, model=None, **kwargs):
    import zerodp

    model = model or make_model()
    base = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, optimizer, loader, scheduler = zerodp.initialize(model=model, config={**base, **config}, **kwargs)
    return engine


def _micro(engine, rank: int, step: int, micro: int, loss_factor: float = 1.0) -> torch.Tensor:
    loss = engine(*batch(rank, step, micro)) * loss_factor
    returned = engine.backward(loss)
    engine.step()
    return returned


# --- accumulation and counters --------------------------------------------------------------


def _accumulation(rank: int, world: int):
    from zerodp import comm

    engine = _engine({"gradient_accumulation_steps": 3})
    seen = []
    for micro in range(6):
        boundary = engine.is_gradient_accumulation_boundary()
        loss = engine(*batch(rank, 0, micro))
        returned = engine.backward(loss)
        off_boundary_traffic = sum(r.numel for r in comm.ledger.current.values())
        engine.step()
        seen.append((boundary, off_boundary_traffic, engine.global_steps, engine.global_samples,
                     torch.allclose(returned, loss / 3)))
    return seen


def test_step_only_at_boundary_and_no_traffic_between() -> None:
    for seen in run_ranks(_accumulation, 2):
        assert [s[0] for s in seen] == [False, False, True] * 2
        # off the boundary backward communicates nothing; at the boundary it all-reduces
        assert [s[1] == 0 for s in seen] == [True, True, False] * 2
        assert [s[2] for s in seen] == [0, 0, 1, 1, 1, 2]
        assert [s[3] for s in seen] == [0, 0, 24, 24, 24, 48]  # train_batch_size = 4 x 3 x 2
        assert all(s[4] for s in seen), "backward returns loss / gradient_accumulation_steps"


# --- overflow -----------------------------------------------------------------------------------


def _overflow_on_rank1(rank: int, world: int):
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                                  "warmup_type": "linear"}}})
    _micro(engine, rank, 0, 0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    lr_before = engine.get_lr()
    # An inf loss on rank 1 only: its gradients are inf/nan, rank 0's are finite.
    _micro(engine, rank, 1, 0, loss_factor=float("inf") if rank == 1 else 1.0)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    record = (engine.skipped_steps, engine.global_steps, engine.loss_scale, unchanged,
              engine.get_lr() == lr_before, engine.was_step_applied())
    _micro(engine, rank, 2, 0)
    return record, engine.was_step_applied(), engine.loss_scale


def test_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    for (skipped, steps, scale, unchanged, lr_kept, applied), applied_after, _ in run_ranks(_overflow_on_rank1, 2):
        assert (skipped, steps) == (1, 2)
        assert scale == 8.0  # 2**4 halved (hysteresis 1)
        assert unchanged, "parameters must not move on a skipped step"
        assert lr_kept, "the scheduler is not stepped on a skipped step"
        assert not applied and applied_after


def _persistent_overflow(rank: int, world: int):
    from zerodp.precision import LossScaleAtMinimumError

    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}})
    try:
        for step in range(5):
            _micro(engine, rank, step, 0, loss_factor=float("nan"))
    except LossScaleAtMinimumError as err:
        return str(err), engine.skipped_steps
    return None, engine.skipped_steps


def test_persistent_overflow_at_minimum_scale_says_what_to_do() -> None:
    for message, skipped in run_ranks(_persistent_overflow, 2):
        assert message is not None and "bf16" in message and "initial_scale_power" in message
        assert skipped == 1  # scale 2 -> 1 on the first overflow, the second one at the minimum raises


# --- ledgers --------------------------------------------------------------------------------------


def _ledgers(rank: int, world: int, precision: dict):
    engine = _engine(precision)
    per_step = []
    for step in range(3):
        _micro(engine, rank, step, 0)
        per_step.append(engine.comm_report()["last_step"])
    params = list(engine.module.parameters())
    numel = sum(p.numel() for p in params)
    if any(s != per_step[0] for s in per_step):
        raise AssertionError(f"steps communicated differently: {per_step}")
    return engine.memory_report(), engine.comm_report(), numel, len(params)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_ledger_is_design_formula_exactly(world: int) -> None:
    for memory, comms, numel, num_tensors in run_ranks(_ledgers, world, args=({},)):
        held = memory["held"]
        assert held["param32_master"]["cpu"] == 4 * numel
        assert held["grad"]["cpu"] == 4 * numel
        # AdamW: exp_avg + exp_avg_sq (8 bytes per element) + one fp32 step counter per tensor
        assert held["optim_state"]["cpu"] == 8 * numel + 4 * num_tensors
        assert memory["model_states"] == 16 * numel + 4 * num_tensors
        step = comms["last_step"]
        expected = 2 * numel if world > 1 else 0  # all-reduce = reduce-scatter + all-gather
        assert step["total_numel"] == expected and step["total_bytes"] == 4 * expected


@pytest.mark.parametrize("precision,grad_bytes", [
    ({"bf16": {"enabled": True}}, 2),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 4),
    ({"fp16": {"enabled": True, "initial_scale_power": 8}}, 2),
])
def test_mixed_precision_ledger(precision: dict, grad_bytes: int) -> None:
    for memory, comms, numel, num_tensors in run_ranks(_ledgers, 2, args=(precision,)):
        held = memory["held"]
        assert held["param16"]["cpu"] == 2 * numel
        assert held["param32_master"]["cpu"] == 4 * numel
        assert held["grad"]["cpu"] == grad_bytes * numel
        assert held["optim_state"]["cpu"] == 8 * numel + 4 * num_tensors
        step = comms["last_step"]
        assert step["total_numel"] == 2 * numel and step["total_bytes"] == grad_bytes * 2 * numel
        if grad_bytes == 2:  # the step casts the reduced 16-bit gradients once to fp32
            assert memory["transient_peak"]["step_grad_fp32"] == 4 * numel


# --- data and errors -----------------------------------------------------------------------------


def _loader(rank: int, world: int):
    data = torch.utils.data.TensorDataset(torch.arange(40))
    engine = _engine({"gradient_accumulation_steps": 2}, training_data=data)
    loader = engine.training_dataloader
    return loader.batch_size, [b[0].tolist() for b in loader]


def test_training_data_gives_each_rank_its_share_in_micro_batches() -> None:
    (size0, batches0), (size1, batches1) = run_ranks(_loader, 2)
    assert size0 == size1 == 4
    seen0 = sorted(x for b in batches0 for x in b)
    seen1 = sorted(x for b in batches1 for x in b)
    assert not set(seen0) & set(seen1) and sorted(seen0 + seen1) == list(range(40))


def _different_models(rank: int, world: int):
    import zerodp

    model = make_model(dim=16 if rank == 0 else 8)
    zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4},
                      optimizer=lambda g: torch.optim.SGD(g, lr=0.1))


def test_ranks_with_different_models_fail_together_with_a_clear_error() -> None:
    with pytest.raises(RankFailed, match=r"ranks \[1\] have a different model parameters"):
        run_ranks(_different_models, 2, timeout=60)


def _bad_config(rank: int, world: int):
    _engine({"zero_optimisation": {"stage": 0}})


def test_bad_config_fails_on_every_rank_before_communicating() -> None:
    with pytest.raises(RankFailed, match="zero_optimization"):
        run_ranks(_bad_config, 2, timeout=60)


def _unbuilt_stage(rank: int, world: int):
    _engine({"zero_optimization": {"stage": 3}})


def test_unbuilt_stage_is_a_clear_error() -> None:
    with pytest.raises(RankFailed, match="stage 3 .* not implemented yet"):
        run_ranks(_unbuilt_stage, 1, timeout=60)


def _user_optimizer_and_scheduler(rank: int, world: int):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    engine = _engine({"bf16": {"enabled": True}}, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    _micro(engine, rank, 0, 0)
    return engine.optimizer is optimizer, engine.get_lr(), optimizer.param_groups[0]["params"][0].dtype


def test_user_optimizer_instance_is_kept_and_steps_fp32_masters() -> None:
    for same, lrs, master_dtype in run_ranks(_user_optimizer_and_scheduler, 1):
        assert same
        assert lrs == pytest.approx([0.05])  # the user's StepLR stepped the same optimizer
        assert master_dtype == torch.float32
