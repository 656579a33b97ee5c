"""engine.offload_states() / reload_states(): the device is freed between phases and training goes on bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.models import batch, make_model, train_steps, two_groups

PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def _engine(stage: int, precision: str):
    import zerodp

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, **PRECISIONS[precision]}
    engine, *_ = zerodp.initialize(model=model, config=config,
                                   optimizer=torch.optim.AdamW(two_groups(model), lr=1e-2))
    return engine


def _weights(engine) -> list[torch.Tensor]:
    import zerodp

    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _with_and_without(rank: int, world: int, stage: int):
    from zerodp.memory import MODEL_STATE_CATEGORIES

    results = {}
    for precision in PRECISIONS:
        plain = _engine(stage, precision)
        expected = train_steps(plain, rank, range(2)), _weights(plain)
        engine = _engine(stage, precision)
        losses = train_steps(engine, rank, range(1))
        before = engine.strategy.ledger()
        engine.offload_states()
        during = engine.strategy.ledger()
        errors = []
        for action in (lambda: engine(*batch(rank, 9, 0)), engine.step,
                       lambda: engine.save_checkpoint("/nonexistent")):
            try:
                action()
            except RuntimeError as err:
                errors.append(str(err))
        engine.offload_states()  # a second call moves nothing more
        engine.reload_states()
        losses += train_steps(engine, rank, range(1, 2))
        device_bytes = [sum(led.bytes(c, "device") for c in MODEL_STATE_CATEGORIES) for led in (before, during)]
        cpu_bytes = [led.bytes(tier="cpu") for led in (before, during)]
        results[precision] = expected, (losses, _weights(engine)), device_bytes, cpu_bytes, errors
    return results


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offloaded_states_come_back_and_training_goes_on_bitwise(stage: int) -> None:
    for results in run_ranks(_with_and_without, 2, args=(stage,)):
        for precision, (expected, got, device_bytes, cpu_bytes, errors) in results.items():
            assert got[0] == expected[0], precision
            assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1])), precision
            assert device_bytes[0] > 0 and device_bytes[1] == 0, device_bytes  # no model state is left
            assert cpu_bytes[1] - cpu_bytes[0] == device_bytes[0], cpu_bytes
            assert len(errors) == 3 and all("call engine.reload_states() first" in e for e in errors), errors


def _only_optimizer_state(rank: int, world: int):
    from zerodp.compat.deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from zerodp.memory import Category

    engine = _engine(2, "bf16")
    train_steps(engine, rank, range(1))
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], pin_memory=False)
    ledger = engine.strategy.ledger()
    held = {c: ledger.bytes(c, "device") for c in (Category.OPTIM_STATE, Category.PARAM16, Category.PARAM32_MASTER)}
    problems = []
    for kwargs in ({"include": ["lp_params", "weights"]}, {"device": "nvme"}):
        try:
            engine.offload_states(**kwargs)
        except ValueError as err:
            problems.append(str(err))
    engine.reload_states()
    return held, problems


def test_include_chooses_what_moves_and_bad_arguments_are_named() -> None:
    from zerodp.memory import Category

    held, problems = run_ranks(_only_optimizer_state, 2)[0]
    assert held[Category.OPTIM_STATE] == 0 and held[Category.PARAM16] > 0 and held[Category.PARAM32_MASTER] > 0
    assert "unknown state ['weights']" in problems[0] and "optim_states" in problems[0]
    assert "only 'cpu' is supported" in problems[1]
