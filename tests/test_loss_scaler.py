"""Loss scalers (DeepSpeed's state machine, step by step), the dtype policy and the overflow check."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest
import torch

from zerodp.precision import (
    DtypePolicy,
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    first_nonfinite,
    has_inf_or_nan,
    make_loss_scaler,
    overflow_message,
)

OVERFLOW, GOOD = True, False


def run(scaler, steps) -> list[float]:
    """The scale after each update."""
    scales = []
    for overflow in steps:
        scaler.update(overflow)
        scales.append(scaler.loss_scale)
    return scales


# ------------------------------------------------------------------------------- state machine


def test_defaults_are_deepspeeds():
    scaler = DynamicLossScaler()
    assert scaler.loss_scale == 65536.0 and scaler.dynamic is True
    settings = (scaler.scale_factor, scaler.scale_window, scaler.min_scale, scaler.delayed_shift)
    assert settings == (2.0, 1000, 1.0, 2)
    assert scaler.consecutive_hysteresis is False and scaler.raise_error_at_min_scale is True
    assert scaler.cur_scale == scaler.loss_scale


def test_hysteresis_two_absorbs_the_first_overflow_then_halves():
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=100, delayed_shift=2)
    scaler.update(OVERFLOW)
    assert scaler.loss_scale == 1024.0 and scaler.cur_hysteresis == 1  # absorbed
    scaler.update(OVERFLOW)
    assert scaler.loss_scale == 512.0
    # Without consecutive_hysteresis and without growth, the counter is not refilled: good steps in
    # between do not protect the next overflow.
    assert run(scaler, [GOOD, GOOD, OVERFLOW, GOOD, OVERFLOW]) == [512.0, 512.0, 256.0, 256.0, 128.0]


def test_doubling_on_the_window_plus_first_good_step_then_every_window():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3, delayed_shift=1)
    # From the start (last overflow iteration -1): good steps 1..3 keep it, the 4th doubles.
    assert run(scaler, [GOOD] * 4) == [8.0, 8.0, 8.0, 16.0]
    assert run(scaler, [GOOD] * 3) == [16.0, 16.0, 32.0]  # then every window (3) good steps
    assert run(scaler, [OVERFLOW]) == [16.0]
    # After an overflow: the (window+1)-th good step doubles, then every window.
    assert run(scaler, [GOOD] * 7) == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]
    assert scaler.cur_iter == 15 and scaler.last_overflow_iter == 7


def test_growth_refills_hysteresis_without_consecutive_hysteresis():
    scaler = DynamicLossScaler(init_scale=64.0, scale_window=2, delayed_shift=2)
    # iter 0 overflow (absorbed, counter 1); iters 1, 2 good; iter 3: stable 2 -> x2 and refill to 2
    assert run(scaler, [OVERFLOW, GOOD, GOOD, GOOD]) == [64.0, 64.0, 64.0, 128.0]
    assert scaler.cur_hysteresis == 2
    assert run(scaler, [OVERFLOW]) == [128.0]  # absorbed again thanks to the refill


def test_consecutive_hysteresis_refills_on_every_good_step():
    steps = [OVERFLOW, GOOD, OVERFLOW, GOOD, OVERFLOW, OVERFLOW]
    consecutive = DynamicLossScaler(init_scale=64.0, scale_window=100, delayed_shift=2,
                                    consecutive_hysteresis=True)
    plain = DynamicLossScaler(init_scale=64.0, scale_window=100, delayed_shift=2)
    assert run(consecutive, steps) == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]
    assert run(plain, steps) == [64.0, 64.0, 32.0, 32.0, 16.0, 8.0]


def test_min_scale_clamp_then_error_with_pinned_message():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=3.0, delayed_shift=1)
    assert run(scaler, [OVERFLOW]) == [3.0]  # max(4 / 2, 3)
    pinned = (r"loss scale is at its minimum \(3 = fp16\.min_loss_scale\) and the gradients still overflow "
              r"\(inf/nan\): the overflow is persistent")
    with pytest.raises(LossScaleAtMinimumError, match=pinned) as info:
        scaler.update(OVERFLOW)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    for advice in ('"bf16": {"enabled": true}', "fp16.min_loss_scale", "fp16.initial_scale_power"):
        assert advice in message


def test_hysteresis_still_absorbs_at_min_scale_and_no_error_when_disabled():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, delayed_shift=2)
    scaler.update(OVERFLOW)  # absorbed by hysteresis, no error yet
    with pytest.raises(LossScaleAtMinimumError):
        scaler.update(OVERFLOW)
    lenient = DynamicLossScaler(init_scale=2.0, min_scale=1.0, delayed_shift=1,
                                raise_error_at_min_scale=False)
    assert run(lenient, [OVERFLOW, OVERFLOW, OVERFLOW]) == [1.0, 1.0, 1.0]


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128.0)
    assert scaler.dynamic is False
    assert run(scaler, [OVERFLOW, GOOD] * 50) == [128.0] * 100
    assert float(scaler.scale_loss(torch.tensor(2.0))) == 256.0
    assert json.loads(json.dumps(scaler.state_dict())) == {"type": "static", "loss_scale": 128.0}


def test_state_dict_is_json_and_resumes_identically():
    rng = random.Random(0)
    steps = [rng.random() < 0.2 for _ in range(200)]
    reference = DynamicLossScaler(init_scale=2.0**10, scale_window=5, delayed_shift=2, min_scale=0.25)
    run(reference, steps[:100])
    state = json.loads(json.dumps(reference.state_dict()))
    resumed = DynamicLossScaler(init_scale=2.0**10, scale_window=5, delayed_shift=2, min_scale=0.25)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == reference.state_dict()
    assert run(resumed, steps[100:]) == run(reference, steps[100:])
    assert resumed.state_dict() == reference.state_dict()


def test_invalid_settings_name_the_fp16_keys():
    with pytest.raises(ValueError) as info:
        DynamicLossScaler(scale_window=0, min_scale=-1.0, delayed_shift=0)
    for key in ("fp16.loss_scale_window", "fp16.min_loss_scale", "fp16.hysteresis"):
        assert key in str(info.value)


# ---------------------------------------------------------------------------- make_loss_scaler


def fp16_section(**overrides):
    section = dict(enabled=True, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                   consecutive_hysteresis=False, min_loss_scale=1.0)
    section.update(overrides)
    return SimpleNamespace(**section)


def test_make_loss_scaler_from_fp16_section():
    assert make_loss_scaler(fp16_section(enabled=False)).state_dict() == {"type": "static", "loss_scale": 1.0}
    static = make_loss_scaler(fp16_section(loss_scale=128))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 128.0
    dynamic = make_loss_scaler(fp16_section(initial_scale_power=12, loss_scale_window=50, hysteresis=3,
                                            consecutive_hysteresis=True, min_loss_scale=0.5))
    assert isinstance(dynamic, DynamicLossScaler)
    settings = (dynamic.loss_scale, dynamic.scale_window, dynamic.delayed_shift, dynamic.min_scale)
    assert settings == (4096.0, 50, 3, 0.5)
    assert dynamic.consecutive_hysteresis is True
    assert make_loss_scaler({"enabled": True}).loss_scale == 65536.0  # a dict, DeepSpeed's defaults
    with pytest.raises(ValueError, match="fp16.loss_scale_window"):
        make_loss_scaler(fp16_section(loss_scale_window=0))


def test_overflow_message_names_the_scales_and_the_parameter():
    scaler = DynamicLossScaler(init_scale=1024.0, delayed_shift=1)
    scaler.update(OVERFLOW)
    line = overflow_message(7, 1024.0, scaler, "layers.3.mlp.weight")
    assert line == ("OVERFLOW at step 7: step skipped on every rank; loss scale 1024 -> 512; "
                    "first inf/nan gradient on this rank: layers.3.mlp.weight")
    absorbing = DynamicLossScaler(init_scale=1024.0, delayed_shift=2)
    absorbing.update(OVERFLOW)
    assert "kept at 1024 (hysteresis left: 1)" in overflow_message(1, 1024.0, absorbing, None)


# ---------------------------------------------------------------------------------- DtypePolicy


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def config(precision, grad_accum_dtype=None):
    return SimpleNamespace(precision=precision, data_types=SimpleNamespace(grad_accum_dtype=grad_accum_dtype))


@pytest.mark.parametrize("precision, accum, param_dtype, accum_dtype", [
    ("fp32", None, F32, F32),
    ("fp32", "fp32", F32, F32),
    ("bf16", None, BF16, BF16),      # DeepSpeed: None means the param dtype
    ("bf16", "bf16", BF16, BF16),
    ("bf16", "fp32", BF16, F32),
    ("fp16", None, F16, F16),
    ("fp16", "fp16", F16, F16),
    ("fp16", "fp32", F16, F32),
    ("bf16", "float32", BF16, F32),  # DeepSpeed's alias spellings
])
def test_dtype_policy_valid_combinations(precision, accum, param_dtype, accum_dtype):
    policy = DtypePolicy.from_config(config(precision, accum))
    assert policy.param_dtype == param_dtype
    assert policy.grad_accum_dtype == accum_dtype
    assert policy.reduce_dtype == accum_dtype
    assert policy.master_dtype == F32
    assert policy.needs_master_copy is (param_dtype != F32)


@pytest.mark.parametrize("precision, accum", [
    ("fp16", "bf16"), ("bf16", "fp16"), ("fp32", "bf16"), ("fp32", "fp16"),
])
def test_dtype_policy_rejects_unsupported_accumulation(precision, accum):
    with pytest.raises(ValueError, match=rf'data_types\.grad_accum_dtype = "{accum}" is not supported with '
                                         rf"{precision} training.*Fix: set data_types\.grad_accum_dtype"):
        DtypePolicy.from_config(config(precision, accum))


def test_dtype_policy_rejects_unknown_names_and_is_frozen():
    with pytest.raises(ValueError, match=r"data_types\.grad_accum_dtype = 'fp8'"):
        DtypePolicy.from_config(config("bf16", "fp8"))
    with pytest.raises(ValueError, match="precision = 'fp8'"):
        DtypePolicy.from_config(config("fp8"))
    policy = DtypePolicy.from_config(SimpleNamespace(precision="bf16"))  # no data_types section
    assert policy.grad_accum_dtype == BF16
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = F32


# ------------------------------------------------------------------------------ overflow check


def test_has_inf_or_nan_is_one_device_tensor():
    # fp16's largest finite value; fp32 values whose sum (not their max) would overflow
    finite = [torch.ones(3), torch.full((2,), 65504.0, dtype=F16), torch.full((4,), 3e38)]
    found = has_inf_or_nan(finite)
    assert isinstance(found, torch.Tensor) and found.dim() == 0 and found.dtype == torch.bool
    assert not bool(found)
    assert bool(has_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("inf")], dtype=F16)]))
    assert bool(has_inf_or_nan([torch.tensor([float("nan")], dtype=BF16), torch.ones(2)]))
    assert bool(has_inf_or_nan([torch.tensor([-float("inf")])]))


def test_has_inf_or_nan_ignores_none_and_empty():
    assert not bool(has_inf_or_nan([]))
    assert not bool(has_inf_or_nan([None, torch.empty(0), torch.zeros(2)]))
    assert bool(has_inf_or_nan([None, torch.empty(0), torch.tensor([float("nan")])]))


def test_first_nonfinite_names_the_first_bad_tensor():
    named = [("embed.weight", torch.ones(2)), ("skip", None),
             ("layers.0.weight", torch.tensor([1.0, float("nan")])),
             ("layers.1.weight", torch.tensor([float("inf")]))]
    assert first_nonfinite(named) == "layers.0.weight"
    assert first_nonfinite(dict(named[:2])) is None
    assert first_nonfinite({"a": torch.ones(1), "b": torch.tensor([float("inf")], dtype=F16)}) == "b"
