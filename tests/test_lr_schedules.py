"""DeepSpeed's lr schedulers: curves against hand-computed values, groups, resume, errors, lookup.

Expected values are written from the formulas in the test (or as literals), never by calling the
module's own schedule functions. "lr at iteration k" means after the (k+1)-th `step()`.
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

from zerodp.lr_schedules import (
    DEEPSPEED_SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_optimizer(lrs=(0.1,), cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return cls(groups, lr=lrs[0], **kwargs)


def lrs_after_each_step(scheduler, num_steps: int) -> list[list[float]]:
    """lrs[k] = the optimizer's lrs at iteration k."""
    curve = []
    for _ in range(num_steps):
        scheduler.step()
        curve.append([group["lr"] for group in scheduler.optimizer.param_groups])
    return curve


def assert_close(actual, expected):
    assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------------ WarmupLR


def test_warmup_lr_log_with_two_groups_warms_each_to_its_own_lr():
    optimizer = make_optimizer((0.1, 0.2))
    scheduler = WarmupLR(optimizer, warmup_num_steps=10)  # warmup_max_lr=None -> each group's lr
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # iteration -1 = warmup_min_lr
    curve = lrs_after_each_step(scheduler, 16)
    # lr at k = max * ln(k+1)/ln(10): ln2/ln10 = 0.30102999566, ln5/ln10 = 0.69897000434
    assert_close(curve[0], [0.0, 0.0])
    assert_close(curve[1], [0.030102999566398, 0.060205999132796])
    assert_close(curve[4], [0.069897000433602, 0.139794000867204])
    assert_close(curve[9], [0.1, 0.2])
    assert_close(curve[15], [0.1, 0.2])  # held at max
    assert scheduler.get_last_lr() == curve[15]


def test_warmup_lr_log_with_min_and_max():
    scheduler = WarmupLR(make_optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=10)
    curve = lrs_after_each_step(scheduler, 10)
    for k in (0, 2, 6, 9):
        assert_close(curve[k], [0.01 + (0.11 - 0.01) * math.log(k + 1) / math.log(10)])


def test_warmup_lr_linear_and_per_group_lists():
    optimizer = make_optimizer((0.5, 0.5))
    scheduler = WarmupLR(optimizer, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[0.4, 0.5],
                         warmup_num_steps=4, warmup_type="linear")
    curve = lrs_after_each_step(scheduler, 6)
    assert_close(curve[0], [0.0, 0.1])
    assert_close(curve[1], [0.1, 0.2])   # k/N = 1/4 of the 0.4 gap
    assert_close(curve[3], [0.3, 0.4])
    assert_close(curve[4], [0.4, 0.5])
    assert_close(curve[5], [0.4, 0.5])


def test_warmup_num_steps_is_clamped_to_two():
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    curve = lrs_after_each_step(scheduler, 3)
    assert_close([c[0] for c in curve], [0.0, 0.5, 1.0])  # N = max(2, 1) = 2


def test_resume_construction_does_not_touch_the_optimizer():
    optimizer = make_optimizer((0.1,))
    optimizer.param_groups[0]["lr"] = 0.0777
    scheduler = WarmupLR(optimizer, warmup_max_lr=0.1, warmup_num_steps=10, last_batch_iteration=4)
    assert optimizer.param_groups[0]["lr"] == 0.0777
    scheduler.step()
    assert_close([optimizer.param_groups[0]["lr"]], [0.1 * math.log(6) / math.log(10)])


def test_step_with_explicit_iteration():
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=10)
    scheduler.step(3)
    assert_close(scheduler.get_last_lr(), [math.log(4) / math.log(10)])
    scheduler.step(batch_iteration=8)  # DeepSpeed's keyword for OneCycle / LRRangeTest
    assert_close(scheduler.get_lr(), [math.log(9) / math.log(10)])


def test_tensor_lr_stays_a_tensor():
    optimizer = make_optimizer((0.1,), cls=torch.optim.Adam, foreach=False)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.1)
    scheduler = WarmupLR(optimizer, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    scheduler.step()
    scheduler.step()
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.025, rel=1e-6)  # float32 tensor


# ------------------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_linear_decays_to_min_at_total():
    scheduler = WarmupDecayLR(make_optimizer(), total_num_steps=10, warmup_max_lr=0.1,
                              warmup_num_steps=4, warmup_type="linear")
    curve = [c[0] for c in lrs_after_each_step(scheduler, 13)]
    # warmup k/4, then (10 - k) / (10 - 4)
    expected = {0: 0.0, 2: 0.05, 3: 0.075, 4: 0.1, 7: 0.05, 9: 0.1 / 6, 10: 0.0, 12: 0.0}
    for k, lr in expected.items():
        assert_close([curve[k]], [lr])


def test_warmup_decay_lr_ends_at_warmup_min_lr_and_defaults_to_peak_0_001():
    optimizer = make_optimizer((0.5,))
    scheduler = WarmupDecayLR(optimizer, total_num_steps=6, warmup_min_lr=0.0001, warmup_num_steps=2)
    curve = [c[0] for c in lrs_after_each_step(scheduler, 8)]
    assert_close([curve[2]], [0.001])  # the default peak, not the optimizer's 0.5
    assert_close([curve[4]], [0.0001 + 0.0009 * 2 / 4])
    assert_close([curve[6], curve[7]], [0.0001, 0.0001])


# ------------------------------------------------------------------------------------ WarmupCosineLR


def test_warmup_cosine_lr_scales_each_groups_original_lr():
    optimizer = make_optimizer((0.1, 0.2))
    scheduler = WarmupCosineLR(optimizer, total_num_steps=10, warmup_min_ratio=0.2, warmup_num_steps=4,
                               cos_min_ratio=0.1, warmup_type="linear")
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # iteration -1: ratio 0
    curve = lrs_after_each_step(scheduler, 21)
    ratios = {
        0: 0.2,                      # warmup_min_ratio
        2: 0.2 + 0.8 * 2 / 4,
        3: 0.2 + 0.8 * 3 / 4,
        4: 0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 6)) / 2,  # progress (4-4+1)/(10-4)
        6: 0.1 + 0.9 * 0.5,          # progress 1/2: cos = 0
        9: 0.1,                      # progress 1
        20: 0.1,                     # clamped: stays at cos_min_ratio
    }
    for k, ratio in ratios.items():
        assert_close(curve[k], [0.1 * ratio, 0.2 * ratio])
    assert_close([curve[4][0]], [0.093971143170300])


def test_warmup_cosine_lr_log_warmup():
    scheduler = WarmupCosineLR(make_optimizer((1.0,)), total_num_steps=100, warmup_num_steps=10)
    curve = lrs_after_each_step(scheduler, 10)
    assert_close(curve[4], [math.log(5) / math.log(10)])
    assert_close(curve[9], [1.0])
    assert_close([scheduler.get_lr_ratio()], [1.0])


# --------------------------------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous_and_staircase():
    continuous = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                             lr_range_test_step_rate=0.5)
    assert continuous.optimizer.param_groups[0]["lr"] == 0.01
    curve = [c[0] for c in lrs_after_each_step(continuous, 8)]
    # min * (1 + 0.5 * (k+1)/4)
    assert_close([curve[0], curve[3], curve[7]], [0.01125, 0.015, 0.02])

    stairs = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                         lr_range_test_step_rate=0.5, lr_range_test_staircase=True)
    curve = [c[0] for c in lrs_after_each_step(stairs, 8)]
    assert_close(curve, [0.01, 0.01, 0.01, 0.015, 0.015, 0.015, 0.015, 0.02])


# ------------------------------------------------------------------------------------------ OneCycle


def test_one_cycle_lr_and_beta1_through_both_phases_and_decay():
    optimizer = make_optimizer((0.5,), betas=(0.9, 0.95))
    scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                         cycle_second_step_size=6, decay_step_size=2, decay_lr_rate=0.5, decay_mom_rate=0.1)
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.95)  # low lr, high momentum
    lrs, betas = [], []
    for _ in range(14):
        scheduler.step()
        lrs.append(group["lr"])
        betas.append(group["betas"])
    # position p = k+1: up for 4 steps (scale p/4), down for 6 (scale (10-p)/6)
    expected = {0: (0.0325, 0.875), 3: (0.1, 0.8), 5: (0.07, 0.9 - 0.1 * 4 / 6), 9: (0.01, 0.9)}
    for k, (lr, beta1) in expected.items():
        assert_close([lrs[k], betas[k][0]], [lr, beta1])
    # decay: d = k - 10 + 1 steps after the cycle, lr = 0.01 / (1 + 0.5 * d / 2)
    assert_close([lrs[10], lrs[13]], [0.008, 0.005])
    assert_close([betas[13][0]], [0.9 / (1 + 0.1 * 4 / 2)])
    assert all(beta[1] == 0.95 for beta in betas)  # beta2 is never touched
    assert_close(scheduler.get_mom(), [0.75])


def test_one_cycle_holds_min_lr_and_max_momentum_without_decay():
    optimizer = make_optimizer((0.5,))
    scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    lrs_after_each_step(scheduler, 10)
    assert_close([optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"][0]], [0.01, 0.9])


def test_one_cycle_stairs():
    scheduler = OneCycle(make_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=10,
                         cycle_first_stair_count=5, cycle_second_stair_count=2, cycle_momentum=False)
    curve = [c[0] for c in lrs_after_each_step(scheduler, 22)]
    # rising: floor(p * 5 / 10) / 5 for p = k+1; falling: floor((20 - p) * 2 / 10) / 2
    assert_close(curve[:10], [0.0, 0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8, 1.0])
    assert_close(curve[10:20], [0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert_close(curve[20:], [0.0, 0.0])


def test_one_cycle_cycles_sgd_momentum_and_skips_optimizers_without_momentum():
    sgd = make_optimizer((0.1,), cls=torch.optim.SGD, momentum=0.5)
    scheduler = OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    scheduler.step()
    assert_close([sgd.param_groups[0]["momentum"]], [0.875])

    adagrad = make_optimizer((0.1,), cls=torch.optim.Adagrad)
    scheduler = OneCycle(adagrad, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    scheduler.step()
    assert scheduler.cycle_momentum is False and scheduler.get_mom() is None
    assert_close([adagrad.param_groups[0]["lr"]], [0.0325])


# ------------------------------------------------------------------------------------ state_dict


RESUMABLE = [
    (WarmupLR, {"warmup_num_steps": 6}),
    (WarmupDecayLR, {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 0.3}),
    (WarmupCosineLR, {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_type": "linear"}),
    (LRRangeTest, {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
    (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                "decay_step_size": 2, "decay_lr_rate": 0.1}),
]


@pytest.mark.parametrize("cls, params", RESUMABLE, ids=[cls.__name__ for cls, _ in RESUMABLE])
def test_state_dict_round_trip_resumes_the_same_curve(cls, params):
    reference = cls(make_optimizer((0.1, 0.2)), **params)
    lrs_after_each_step(reference, 7)
    state = json.loads(json.dumps(reference.state_dict()))  # plain data
    assert state["last_batch_iteration"] == 6

    resumed_optimizer = make_optimizer((0.1, 0.2))
    resumed = cls(resumed_optimizer, **params)
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == reference.get_last_lr()  # loading writes iteration 6's lr
    assert [g.get("betas") for g in resumed_optimizer.param_groups] == [
        g.get("betas") for g in reference.optimizer.param_groups]
    assert lrs_after_each_step(resumed, 8) == lrs_after_each_step(reference, 8)


def test_resume_keeps_the_lrs_read_from_the_optimizer():
    reference = WarmupLR(make_optimizer((0.1, 0.2)), warmup_num_steps=10)
    lrs_after_each_step(reference, 3)
    # Built on an optimizer whose lr already holds a scheduled value: base_lrs come from the state.
    resumed = WarmupLR(make_optimizer((0.03, 0.06)), warmup_num_steps=10, last_batch_iteration=2)
    resumed.load_state_dict(reference.state_dict())
    assert lrs_after_each_step(resumed, 9) == lrs_after_each_step(reference, 9)


def test_load_deepspeed_state_dict_and_reject_garbage():
    scheduler = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=10)
    scheduler.load_state_dict({"last_batch_iteration": 4})
    assert_close(scheduler.get_last_lr(), [math.log(5) / math.log(10)])
    with pytest.raises(ValueError, match="last_batch_iteration"):
        scheduler.load_state_dict({"iteration": 4})


# ---------------------------------------------------------------------------------------- errors


BAD_PARAMS = [
    (WarmupLR, {"warmup_type": "cosine"}, r"scheduler\.params\.warmup_type = 'cosine'.*'log' or 'linear'"),
    (WarmupLR, {"warmup_num_steps": 0}, r"scheduler\.params\.warmup_num_steps = 0"),
    (WarmupLR, {"warmup_num_steps": 10.5}, r"scheduler\.params\.warmup_num_steps = 10\.5"),
    (WarmupLR, {"warmup_min_lr": 0.5, "warmup_max_lr": 0.1}, r"scheduler\.params\.warmup_min_lr = 0\.5"),
    (WarmupLR, {"warmup_max_lr": [0.1, 0.2, 0.3]}, r"scheduler\.params\.warmup_max_lr.*list of 1"),
    (WarmupDecayLR, {"total_num_steps": 5, "warmup_num_steps": 10},
     r"scheduler\.params\.total_num_steps = 5: expected >= warmup_num_steps \(10\)"),
    (WarmupCosineLR, {"total_num_steps": 100, "cos_min_ratio": 1.5},
     r"scheduler\.params\.cos_min_ratio = 1\.5"),
    (WarmupCosineLR, {"total_num_steps": 3}, r"scheduler\.params\.total_num_steps = 3"),
    (OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.01},
     r"scheduler\.params\.cycle_max_lr = 0\.01: expected >= cycle_min_lr \(0\.1\).*Fix: swap"),
    (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
     r"scheduler\.params\.cycle_first_step_size = 0"),
    (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_min_mom": 0.95},
     r"scheduler\.params\.cycle_max_mom = 0\.9: expected >= cycle_min_mom"),
    (LRRangeTest, {"lr_range_test_step_size": 0}, r"scheduler\.params\.lr_range_test_step_size = 0"),
    (LRRangeTest, {"lr_range_test_min_lr": -1.0}, r"scheduler\.params\.lr_range_test_min_lr = -1\.0"),
]


@pytest.mark.parametrize("cls, params, message", BAD_PARAMS)
def test_bad_params_name_the_key_the_value_and_the_fix(cls, params, message):
    with pytest.raises(ValueError, match=message) as info:
        cls(make_optimizer(), **params)
    assert "Fix:" in str(info.value)


def test_all_problems_are_reported_together():
    with pytest.raises(ValueError) as info:
        WarmupDecayLR(make_optimizer(), total_num_steps=0, warmup_num_steps=-1, warmup_type="exp")
    message = str(info.value)
    for key in ("total_num_steps", "warmup_num_steps", "warmup_type"):
        assert f"scheduler.params.{key}" in message


# ------------------------------------------------------------------------------ lookup by name


def test_deepspeed_signatures_match_deepspeed():
    """The config validator reads these: names, required-ness and defaults are DeepSpeed's."""
    def params_of(cls):
        signature = inspect.signature(cls.__init__)
        return {name: p.default for name, p in signature.parameters.items()
                if name not in ("self", "optimizer")}

    empty = inspect.Parameter.empty
    assert params_of(DEEPSPEED_SCHEDULERS["WarmupLR"]) == {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
        "last_batch_iteration": -1}
    assert params_of(DEEPSPEED_SCHEDULERS["WarmupDecayLR"]) == {
        "total_num_steps": empty, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log", "last_batch_iteration": -1}
    assert params_of(DEEPSPEED_SCHEDULERS["WarmupCosineLR"]) == {
        "total_num_steps": empty, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
        "warmup_type": "log", "last_batch_iteration": -1}
    assert params_of(DEEPSPEED_SCHEDULERS["LRRangeTest"]) == {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False, "last_batch_iteration": -1}
    assert params_of(DEEPSPEED_SCHEDULERS["OneCycle"]) == {
        "cycle_min_lr": empty, "cycle_max_lr": empty, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1}



def test_the_config_layer_table_is_the_classes_signatures():
    """The config validates scheduler.params from its own table (it cannot import this package):
    every class's parameters, their order, defaults and required-ness must be that row."""
    from zerodp.config.schedulers import DEEPSPEED_SCHEDULER_NAMES, DEEPSPEED_SCHEDULER_PARAMS, REQUIRED

    assert sorted(DEEPSPEED_SCHEDULERS) == sorted(DEEPSPEED_SCHEDULER_PARAMS) == sorted(DEEPSPEED_SCHEDULER_NAMES)
    for name, cls in DEEPSPEED_SCHEDULERS.items():
        signature = inspect.signature(cls.__init__)
        params = [(key, REQUIRED if p.default is inspect.Parameter.empty else p.default)
                  for key, p in signature.parameters.items() if key not in ("self", "optimizer")]
        assert params == list(DEEPSPEED_SCHEDULER_PARAMS[name].items()), name


@pytest.mark.parametrize("cls, params, message",
                         [case for case in BAD_PARAMS if not any(isinstance(v, list) for v in case[1].values())])
def test_the_config_refuses_what_the_class_refuses_in_its_words(cls, params, message):
    """`zerodp config check` and the class at construction give the same problems (per-group lists
    aside: the config cannot know how many param groups the optimizer will have)."""
    from zerodp.config import ConfigError, load_config

    with pytest.raises(ValueError) as built:
        cls(make_optimizer(), **params)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "scheduler": {"type": cls.__name__, "params": params}}
    with pytest.raises(ConfigError) as loaded:
        load_config(config, world_size=1)
    assert loaded.value.problems == built.value.problems

def test_build_scheduler_deepspeed_name():
    optimizer = make_optimizer((0.1,))
    scheduler = build_scheduler("WarmupLR", {"warmup_num_steps": 10, "warmup_type": "linear"}, optimizer)
    assert isinstance(scheduler, WarmupLR)
    scheduler.step(5)
    assert_close(scheduler.get_last_lr(), [0.05])


def test_build_scheduler_torch_name():
    optimizer = make_optimizer((0.1,))
    scheduler = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    optimizer.step()
    scheduler.step()
    optimizer.step()
    scheduler.step()
    assert_close(scheduler.get_last_lr(), [0.05])


def test_build_scheduler_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"scheduler\.type = 'warmupLR'.*WarmupCosineLR.*StepLR") as info:
        build_scheduler("warmupLR", {}, make_optimizer())
    assert "Did you mean 'WarmupLR'" in str(info.value)


def test_build_scheduler_unknown_and_missing_params():
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_steps = 10: expected a parameter of "):
        build_scheduler("WarmupLR", {"warmup_steps": 10}, make_optimizer())
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps = None: .*requires it"):
        build_scheduler("WarmupDecayLR", {"warmup_num_steps": 10}, make_optimizer())
