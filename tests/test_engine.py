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


def _overflow_on_rank1(rank: int, world: int, stage: int):
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
                      "zero_optimization": {"stage": stage},
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


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(stage: int) -> None:
    """At stages 1 and 2 rank 1's inf lands in some owned shards only: the 2-element all-reduce
    must still make every rank skip."""
    for (skipped, steps, scale, unchanged, lr_kept, applied), applied_after, _ in run_ranks(_overflow_on_rank1, 2, args=(stage,)):
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
        assert held["param32_master"]["device"] == 4 * numel
        assert held["grad"]["device"] == 4 * numel
        # AdamW: exp_avg + exp_avg_sq (8 bytes per element) + one fp32 step counter per tensor
        assert held["optim_state"]["device"] == 8 * numel + 4 * num_tensors
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
        assert held["param16"]["device"] == 2 * numel
        assert held["param32_master"]["device"] == 4 * numel
        assert held["grad"]["device"] == grad_bytes * numel
        assert held["optim_state"]["device"] == 8 * numel + 4 * num_tensors
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
        run_ranks(_different_models, 2, timeout=100)


def _bad_config(rank: int, world: int):
    _engine({"zero_optimisation": {"stage": 0}})


def test_bad_config_fails_on_every_rank_before_communicating() -> None:
    with pytest.raises(RankFailed, match="zero_optimization"):
        run_ranks(_bad_config, 2, timeout=100)


def _unbuilt_feature(rank: int, world: int):
    _engine({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})


def test_unbuilt_feature_is_a_clear_error() -> None:
    with pytest.raises(RankFailed, match=r"ratio: 0.3 is not supported by zerodp \(partial offload"):
        run_ranks(_unbuilt_feature, 1, timeout=100)


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


# --- stages 1 and 2: ledgers ------------------------------------------------------------------


def _padded(numel: int, world: int) -> tuple[int, int]:
    padded = -(-numel // world) * world
    return padded, padded // world


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_fp32_ledgers_are_design_formulas_exactly(stage: int, world: int) -> None:
    """fp32 + AdamW (one param group): params 4 x padded; grads 4 x padded (stage 1) or 4 x shard
    (stage 2); optimizer state 8 x shard + one 4-byte step. Per step: reduce-scatter (stage 1) or
    per-owner reduces of the parameters' elements (stage 2), an all-gather of the padded buffer,
    and one 2-element all-reduce (norm, overflow flag)."""
    config = {"zero_optimization": {"stage": stage}}
    for memory, comms, numel, _ in run_ranks(_ledgers, world, args=(config,)):
        padded, shard = _padded(numel, world)
        held = memory["held"]
        assert held["param32_master"]["device"] == 4 * padded
        assert held["grad"]["device"] == 4 * (padded if stage == 1 else shard)
        assert held["optim_state"]["device"] == 8 * shard + 4
        ops = comms["last_step"]["ops"]
        if world == 1:
            assert ops == {}
            continue
        reduced = ops["reduce_scatter[float32]"]["numel"] if stage == 1 else ops["reduce[float32]"]["numel"]
        assert reduced == (padded if stage == 1 else numel)
        assert ops["all_gather[float32]"]["numel"] == padded
        assert ops["all_reduce[float32]"] == {"calls": 1, "numel": 4, "bytes": 16, "link_bytes": {"intra_node": 16}}
        assert comms["last_step"]["total_numel"] == reduced + padded + 4


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_bf16_ledger_keeps_masters_and_state_for_the_owned_shard_only(stage: int) -> None:
    for memory, _, numel, _ in run_ranks(_ledgers, 4, args=({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}},)):
        padded, shard = _padded(numel, 4)
        held = memory["held"]
        assert held["param16"]["device"] == 2 * padded
        assert held["param32_master"]["device"] == 4 * shard
        assert held["grad"]["device"] == 2 * (padded if stage == 1 else shard)
        assert held["optim_state"]["device"] == 8 * shard + 4
        # design.md §3, mixed precision: stage 1 = 4Ψ + 12Ψ/N, stage 2 = 2Ψ + 14Ψ/N (+ padding, + step)
        expected = 4 * padded + 12 * shard if stage == 1 else 2 * padded + 14 * shard
        assert memory["model_states"] == expected + 4


def _bf16_ledgers(rank: int, world: int, stage: int) -> list[tuple[dict, int]]:
    """(memory report, trainable numel) with fp32 masters, bf16 masters, and bf16 masters + moments."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    modes = [{"enabled": True}, {"enabled": True, "bf16_master_weights_and_grads": True},
             {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}]
    return [_ledgers(rank, world, {"bf16": bf16, "zero_optimization": zero})[::2] for bf16 in modes]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_weights_ledger_drops_the_fp32_master_and_halves_the_state(stage: int) -> None:
    """bf16.bf16_master_weights_and_grads: the bf16 shard is its own master, so the fp32 master's M
    bytes (4 per owned element) are saved; bf16_optimizer_states: Adam's two moments in bf16, another
    M. Everything else is unchanged, byte for byte."""
    for (before, numel), *low in run_ranks(_bf16_ledgers, 4, args=(stage,)):
        master = before["held"]["param32_master"]["device"]
        assert master == 4 * _padded(numel, 4)[1] or stage == 3  # stage 3 pads per unit
        for bf16_states, (after, _) in zip((False, True), low):
            assert "param32_master" not in after["held"]
            saved_state = master if bf16_states else 0
            assert after["held"]["optim_state"]["device"] == before["held"]["optim_state"]["device"] - saved_state
            assert after["model_states"] == before["model_states"] - master - saved_state
            for category in ("param16", "grad"):
                assert after["held"][category] == before["held"][category]


# --- accumulation controls (found in review) ---------------------------------------------------


def _no_sync_then_step(rank: int, world: int, stage: int):
    engine = _engine({"zero_optimization": {"stage": stage}})
    with engine.no_sync():
        engine.backward(engine(*batch(rank, 0, 0)))
    engine.step()  # the boundary step must reduce what no_sync left local
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 1])
def test_step_after_no_sync_reduces_before_updating(stage: int) -> None:
    params0, params1 = run_ranks(_no_sync_then_step, 2, args=(stage,))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1)), "ranks diverged"


def _no_sync_at_stage2(rank: int, world: int):
    engine = _engine({"zero_optimization": {"stage": 2}})
    with engine.no_sync():
        pass


def test_no_sync_is_refused_at_stage_2() -> None:
    with pytest.raises(RankFailed, match="no_sync.*not possible at ZeRO stage 2"):
        run_ranks(_no_sync_at_stage2, 1)


def _unmanaged(rank: int, world: int):
    from zerodp import comm

    engine = _engine({"managed_gradient_accumulation": False})
    boundaries, traffic = [], []
    for micro in range(3):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*batch(rank, 0, micro)))
        traffic.append(sum(r.numel for r in comm.ledger.current.values()))
    engine.step()
    return boundaries, traffic, engine.global_steps, comm.ledger.last_step


def test_unmanaged_accumulation_reduces_once_inside_step() -> None:
    for boundaries, traffic, steps, last_step in run_ranks(_unmanaged, 2):
        assert boundaries == [False] * 3 and traffic == [0, 0, 0] and steps == 1
        assert sum(r.calls for r in last_step.values()) == 1  # one all-reduce for three backwards


def _two_backwards_and_empty_first_batch(rank: int, world: int):
    engine = _engine({})
    numel = sum(p.numel() for p in engine.module.parameters())
    loss = engine(*batch(rank, 0, 0))
    if rank == 1:  # rank 1's first boundary backward touches no parameter
        loss = torch.zeros((), requires_grad=True)
    engine.backward(loss)
    engine.step()
    for step in range(1, 3):  # two losses back-propagated in one boundary micro-batch
        engine.backward(engine(*batch(rank, step, 0)), retain_graph=False)
        engine.backward(engine(*batch(rank, step, 1)))
        engine.step()
    return engine.memory_report()["held"]["grad"]["device"], 4 * numel


def test_layout_rebuild_neither_hangs_nor_grows() -> None:
    for grad_bytes, expected in run_ranks(_two_backwards_and_empty_first_batch, 2):
        assert grad_bytes == expected


def _frozen_group_user_optimizer(rank: int, world: int, stage: int):
    model = make_model()
    model.fc1.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": list(model.fc1.parameters())},
                                   {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1")]}])
    engine = _engine({"zero_optimization": {"stage": stage}}, model=model, optimizer=optimizer)
    _micro(engine, rank, 0, 0)
    return [len(g["params"]) for g in optimizer.param_groups]


@pytest.mark.parametrize("stage,expected", [(0, [0, 5]), (1, [0, 1])])
def test_user_optimizer_with_an_all_frozen_group(stage: int, expected: list[int]) -> None:
    assert run_ranks(_frozen_group_user_optimizer, 1, args=(stage,)) == [expected]


def _lbfgs(rank: int, world: int):
    model = make_model()
    _engine({"zero_optimization": {"stage": 1}}, model=model, optimizer=torch.optim.LBFGS(model.parameters()))


def test_optimizers_that_are_not_elementwise_are_refused_on_shards() -> None:
    with pytest.raises(RankFailed, match="LBFGS cannot run on ZeRO stage 1's owned shards"):
        run_ranks(_lbfgs, 1)


def _cast_after_initialize(rank: int, world: int, stage: int):
    engine = _engine({"zero_optimization": {"stage": stage}})
    engine.module.double()
    _micro(engine, rank, 0, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_casting_the_model_after_initialize_is_an_error_not_silent_non_training(stage: int) -> None:
    with pytest.raises(RankFailed, match=r"was replaced after initialize\(\)"):
        run_ranks(_cast_after_initialize, 1, args=(stage,))


def _adagrad_instance(rank: int, world: int):
    model = make_model()
    engine = _engine({"zero_optimization": {"stage": 1}}, model=model, optimizer=torch.optim.Adagrad(model.parameters()))
    _micro(engine, rank, 0, 0)
    return engine.global_steps


def test_optimizers_with_eager_initial_state_are_accepted() -> None:
    assert run_ranks(_adagrad_instance, 1) == [1]


def _buffer_dtypes(rank: int, world: int):
    results = {}
    for stage in range(4):
        model = make_model()
        model.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32) / 3)  # a rotary-style table
        model.register_buffer("ids", torch.arange(4))
        engine = _engine({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}, model=model)
        _micro(engine, rank, 0, 0)
        results[stage] = ({n: b.dtype for n, b in engine.module.named_buffers()},
                          {p.dtype for p in engine.module.parameters()},
                          torch.equal(engine.module.inv_freq, torch.arange(4, dtype=torch.float32) / 3))
    return results


def test_buffers_keep_their_dtype_under_bf16_as_in_deepspeed() -> None:
    """DeepSpeed 0.19 casts parameters only; a bf16 copy of an fp32 table changes the model's outputs.
    At stages 0-3."""
    for stage, (buffers, params, exact) in run_ranks(_buffer_dtypes, 2)[0].items():
        assert buffers == {"inv_freq": torch.float32, "ids": torch.int64}, stage
        assert params == {torch.bfloat16} and exact, stage
