"""Tests for zerodp.config: DeepSpeed's schema and defaults, validation, batch math, input forms."""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zerodp.log
from zerodp.config import (
    BatchMath,
    ConfigError,
    ZeroDPConfig,
    add_config_arguments,
    consistent_choices,
    load_config,
    resolve_batch,
)

TRAIN, MICRO, ACCUM = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def problems_of(config: object, **kwargs: object) -> list[str]:
    """The problems load_config reports (fails the test if it reports none)."""
    kwargs.setdefault("world_size", 1)
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return info.value.problems


def one_problem(config: object, **kwargs: object) -> str:
    problems = problems_of(config, **kwargs)
    assert len(problems) == 1, problems
    return problems[0]


def ok(config: dict, world_size: int = 1, **kwargs: object) -> ZeroDPConfig:
    return load_config({TRAIN: world_size, **config}, world_size=world_size, **kwargs)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """warn_once remembers messages process-wide; start each warning test with a clean slate."""
    monkeypatch.setattr(zerodp.log, "_warned", set())


# ---------------------------------------------------------------------------------------------
# Batch rule: reference §2.1, every row
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, ws, expected, derived", [
    ((32, 4, 4), 2, (32, 4, 4), ()),                       # all 3: just checked
    ((32, 4, None), 2, (32, 4, 4), (ACCUM,)),              # tbs + micro: gas = tbs // micro // ws
    ((32, None, 4), 2, (32, 4, 4), (MICRO,)),              # tbs + gas: micro = tbs // ws // gas
    ((None, 4, 4), 2, (32, 4, 4), (TRAIN,)),               # micro + gas: tbs = micro * gas * ws
    ((32, None, None), 2, (32, 16, 1), (MICRO, ACCUM)),    # tbs only: gas = 1, micro = tbs // ws
    ((None, 4, None), 2, (8, 4, 1), (TRAIN, ACCUM)),       # micro only: gas = 1, tbs = micro * ws
])
def test_batch_derivation_table(given: tuple, ws: int, expected: tuple, derived: tuple) -> None:
    batch = resolve_batch(*given, ws)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected
    assert batch.world_size == ws
    assert set(batch.derived) == set(derived)


@pytest.mark.parametrize("given", [(None, None, 4), (None, None, None)])
def test_batch_needs_train_or_micro(given: tuple) -> None:
    with pytest.raises(ConfigError, match="train_batch_size, train_micro_batch_size_per_gpu: neither "
                                          "is set; set at least one of them"):
        resolve_batch(*given, 1)


def test_batch_mismatch_shows_every_factor_and_choices() -> None:
    expected = ("train_batch_size(30) != train_micro_batch_size_per_gpu(4) x "
                "gradient_accumulation_steps(7, derived as 30 // 4 // 1) x world_size(1) = 28; "
                "consistent choices: train_batch_size=28, or train_batch_size=32 with "
                "gradient_accumulation_steps=8, or train_micro_batch_size_per_gpu=3 with "
                "gradient_accumulation_steps=10")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        resolve_batch(30, 4, None, 1)


def test_batch_derived_zero_accumulation_is_explained() -> None:
    expected = ("gradient_accumulation_steps(0, derived as 2 // 4 // 1) must be at least 1: "
                "train_batch_size(2) is smaller than train_micro_batch_size_per_gpu(4) x world_size(1) = 4; "
                "consistent choices: train_batch_size=4 with gradient_accumulation_steps=1, "
                "or train_micro_batch_size_per_gpu=2 with gradient_accumulation_steps=1")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        resolve_batch(2, 4, None, 1)


def test_batch_derived_zero_micro_batch_is_explained() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "train_micro_batch_size_per_gpu(0, derived as 8 // 1 // 16) must be at least 1: "
            "train_batch_size(8) is smaller than world_size(1) x gradient_accumulation_steps(16) = 16")):
        resolve_batch(8, None, 16, 1)
    with pytest.raises(ConfigError, match=re.escape(
            "train_micro_batch_size_per_gpu(0, derived as 2 // 4) must be at least 1")):
        resolve_batch(2, None, None, 4)


def test_batch_floor_leftover_train_only() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "train_batch_size(10) != train_micro_batch_size_per_gpu(2, derived as 10 // 4) x "
            "gradient_accumulation_steps(1, 1 when only train_batch_size is given) x world_size(4) = 8")):
        resolve_batch(10, None, None, 4)


def test_batch_floor_leftover_train_and_accumulation() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "train_batch_size(32) != train_micro_batch_size_per_gpu(10, derived as 32 // 1 // 3) x "
            "gradient_accumulation_steps(3) x world_size(1) = 30; consistent choices: train_batch_size=30")):
        resolve_batch(32, None, 3, 1)


def test_batch_all_given_inconsistent_points_at_world_size() -> None:
    # DeepSpeed pain point #1: "256 != 4 * 8 * 1" because the config was built before dist init.
    with pytest.raises(ConfigError) as info:
        resolve_batch(256, 4, 8, 1)
    (problem,) = info.value.problems
    assert problem.startswith("train_batch_size(256) != train_micro_batch_size_per_gpu(4) x "
                              "gradient_accumulation_steps(8) x world_size(1) = 32;")
    assert "gradient_accumulation_steps=64" in problem
    assert "fit a data-parallel world size of 8" in problem


@pytest.mark.parametrize("args, message", [
    ((0, 4, None, 1), "train_batch_size: got 0; expected an integer > 0"),
    ((8, -1, None, 1), "train_micro_batch_size_per_gpu: got -1; expected an integer > 0"),
    ((8, 4, 0, 1), "gradient_accumulation_steps: got 0; expected an integer > 0"),
    ((True, 4, None, 1), "train_batch_size: got true; expected an integer > 0"),
    ((8, 4, None, 0), "world_size: got 0; expected the data-parallel world size"),
])
def test_resolve_batch_rejects_bad_numbers(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_batch(*args)


def test_batch_describe() -> None:
    batch = resolve_batch(32, 4, None, 2)
    assert batch == BatchMath(32, 4, 4, 2, (ACCUM,))
    assert batch.describe() == ("train_batch_size 32 = train_micro_batch_size_per_gpu 4 x "
                                "gradient_accumulation_steps 4 (derived) x data-parallel world size 2")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_consistent_choices_are_consistent(tbs: int, micro: int, accum: int, ws: int) -> None:
    for choice in consistent_choices(tbs, micro, accum, ws):
        train, m, g = choice
        assert m >= 1 and g >= 1 and train == m * g * ws
        assert choice != (tbs, micro, accum)
        resolve_batch(train, m, g, ws)  # and they pass the rule


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_micro_and_accumulation_always_resolve(micro: int, accum: int, ws: int) -> None:
    assert resolve_batch(None, micro, accum, ws).train_batch_size == micro * accum * ws


def test_batch_problem_reported_with_schema_problems() -> None:
    problems = problems_of({TRAIN: 30, MICRO: 4, "zero_optimisation": {}})
    assert len(problems) == 2
    assert problems[0].startswith("zero_optimisation: unknown key")
    assert problems[1].startswith("train_batch_size(30) != ")


def test_batch_math_skipped_when_a_batch_key_fails_its_type_check() -> None:
    problem = one_problem({TRAIN: "32", MICRO: 5})
    assert problem == 'train_batch_size: got "32"; expected an integer'


def test_load_config_resolves_batch() -> None:
    cfg = load_config({TRAIN: 32, MICRO: 4}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 4, 4)
    assert cfg.world_size == 2
    assert cfg.batch.derived == (ACCUM,)


# ---------------------------------------------------------------------------------------------
# World size: argument, torch.distributed, $WORLD_SIZE, never a silent 1
# ---------------------------------------------------------------------------------------------

def test_world_size_argument_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config({MICRO: 4}, world_size=4).train_batch_size == 16


def test_world_size_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({MICRO: 4})
    assert cfg.world_size == 2 and cfg.train_batch_size == 8


def test_world_size_from_env_named_in_batch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=re.escape("x world_size(3, from $WORLD_SIZE) = 12")):
        load_config({TRAIN: 16, MICRO: 4, ACCUM: 1})


def test_world_size_unknown_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"data-parallel world size: unknown .*never assumes 1.*"
                                          r"world_size=N.*torch.distributed.*zerodp run"):
        load_config({MICRO: 4})


def test_world_size_unknown_reported_with_other_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config({MICRO: 4, "fp16": {"enabld": True}})
    assert len(info.value.problems) == 2


@pytest.mark.parametrize("env", ["abc", "0", "-2"])
def test_world_size_bad_env(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", env)
    with pytest.raises(ConfigError, match=re.escape(f"$WORLD_SIZE: got '{env}'; expected an integer > 0")):
        load_config({MICRO: 4})


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_world_size_bad_argument(bad: object) -> None:
    with pytest.raises(ConfigError, match="world_size argument: got"):
        load_config({MICRO: 4}, world_size=bad)  # type: ignore[arg-type]


def test_world_size_from_torch_distributed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "3")  # torch.distributed outranks the environment
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert load_config({MICRO: 4}).world_size == 1
    finally:
        dist.destroy_process_group()


def test_resolved_config_reloads_at_another_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config({MICRO: 4, ACCUM: 2}, world_size=2)
    assert cfg.train_batch_size == 16
    assert load_config(cfg, world_size=4).train_batch_size == 32  # re-derived, not carried over
    assert load_config(cfg).world_size == 2  # no new information: keeps the explicit world size


# ---------------------------------------------------------------------------------------------
# Unknown keys and did-you-mean
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    ({"zero_optimisation": {"stage": 1}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
    ({"trian_micro_batch_size_per_gpu": 2},
     "trian_micro_batch_size_per_gpu: unknown key; did you mean 'train_micro_batch_size_per_gpu'?"),
    ({"zero_optimization": {"overlap_comms": True}},
     "zero_optimization.overlap_comms: unknown key; did you mean 'overlap_comm'?"),
    ({"overlap_comm": True}, "overlap_comm: unknown key here; did you mean 'zero_optimization.overlap_comm'?"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memmory": False}}},
     "zero_optimization.offload_optimizer.pin_memmory: unknown key; did you mean 'pin_memory'?"),
    ({"Gradient_Clipping": 1.0}, "Gradient_Clipping: unknown key; did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"frobnicate_everything": 1}},
     "zero_optimization.frobnicate_everything: unknown key, not a DeepSpeed config key zerodp knows "
     "(DeepSpeed refuses unknown keys in 'zero_optimization' too)"),
    ({"gradient_clipin": 1.0}, "gradient_clipin: unknown key; did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"stage3_prefetch_buket_size": 10}},
     "zero_optimization.stage3_prefetch_buket_size: unknown key; did you mean 'stage3_prefetch_bucket_size'?"),
    ({"zero_optimization.stagee": 2}, "zero_optimization.stagee: unknown key; did you mean 'zero_optimization.stage'?"),
])
def test_unknown_keys_with_did_you_mean(config: dict, expected: str) -> None:
    assert one_problem({TRAIN: 1, **config}) == expected


def test_several_problems_in_one_error(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({TRAIN: 8, "zero_optimization": {"stage": 5, "overlap_comms": True},
                                "gradient_clipping": -1.0}))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), world_size=1)
    text = str(info.value)
    assert text.startswith(f"3 problems in DeepSpeed config '{path}':\n")
    assert "\n  - zero_optimization.overlap_comms: unknown key; did you mean 'overlap_comm'?" in text
    assert "\n  - zero_optimization.stage: got 5; expected a value <= 3" in text
    assert "\n  - gradient_clipping: got -1.0; expected a value >= 0" in text


# ---------------------------------------------------------------------------------------------
# Types and ranges, named by key path and value
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: got 4; expected a value <= 3"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage: got true; expected an integer, not a boolean"),
    ({"zero_optimization": {"stage": 1.5}}, "zero_optimization.stage: got 1.5; expected an integer"),
    ({"gradient_clipping": "1.0"}, 'gradient_clipping: got "1.0"; expected a number'),
    ({"fp16": {"loss_scale": True}}, "fp16.loss_scale: got true; expected a number, not a boolean"),
    ({"fp16": {"loss_scale": float("inf")}}, "fp16.loss_scale: got Infinity; expected a finite number"),
    ({"fp16": {"loss_scale": -2}}, "fp16.loss_scale: got -2; expected a value >= 0"),
    ({"fp16": {"initial_scale_power": -1}}, "fp16.initial_scale_power: got -1; expected a value >= 0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}},
     "fp16.loss_scale_window: got 0; expected a value > 0 with dynamic loss scaling"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}},
     "fp16.min_loss_scale: got 0.0; expected a value > 0 with dynamic"),
    ({"fp16": {"enabled": "true"}}, 'fp16.enabled: got "true"; expected true or false'),
    ({"fp16": True}, "fp16: got true; expected a JSON object (a section of keys)"),
    ({"zero_optimization": {"reduce_bucket_size": 0}},
     "zero_optimization.reduce_bucket_size: got 0; expected a value > 0"),
    ({"zero_optimization": {"allgather_bucket_size": 0}},
     "zero_optimization.allgather_bucket_size: got 0; expected a value > 0"),
    ({"zero_optimization": {"allgather_bucket_size": 500_000_001}},
     "zero_optimization.allgather_bucket_size: got 500000001; must be even"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0}}},
     "zero_optimization.offload_optimizer.ratio: got 0; expected a value > 0"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio: got 1.5; expected a value <= 1"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device: got \"gpu\"; expected one of 'none', 'cpu' or 'nvme'"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op: got \"max\"; expected one of 'mean' or 'sum'"),
    ({"steps_per_print": 0}, "steps_per_print: got 0; expected a value > 0"),
    ({"optimizer": {"params": {"lr": 0.1}}}, "optimizer.type: missing; this key is required"),
    ({"data_types": {"grad_accum_dtype": "fp64"}}, "data_types.grad_accum_dtype: got \"fp64\"; expected one of"),
    ({"log_level": "loud"}, 'log_level: got "loud"; expected one of debug, info, warning, error, critical'),
])
def test_type_and_range_errors_name_path_and_value(config: dict, expected: str) -> None:
    assert one_problem({TRAIN: 1, **config}).startswith(expected)


def test_static_loss_scale_allows_any_window() -> None:
    assert ok({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}}).fp16.loss_scale == 128.0


def test_a_disabled_fp16_section_may_carry_a_zero_window_and_floor() -> None:
    """DeepSpeed checks the window and the floor only when dynamic scaling runs; so does zerodp."""
    assert ok({"fp16": {"enabled": False, "loss_scale_window": 0, "min_loss_scale": 0}}).fp16.loss_scale_window == 0


def test_sizes_accept_floats_and_become_ints() -> None:
    zero = ok({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_max_live_parameters": 1e9,
                                     "sub_group_size": 1e12}}).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.stage3_max_live_parameters == 10**9 and zero.sub_group_size == 10**12


def test_case_insensitive_enums_are_normalised() -> None:
    cfg = ok({"gradient_allreduce_op": "MEAN", "checkpoint": {"tag_validation": "FAIL"},
              "data_types": {"grad_accum_dtype": "float32"}})
    assert cfg.gradient_allreduce_op == "mean"
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.data_types.grad_accum_dtype == "fp32"


def test_offload_devices_are_lower_case_as_in_deepspeed() -> None:
    assert one_problem({TRAIN: 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "CPU"}}}) == (
        'zero_optimization.offload_optimizer.device: got "CPU"; device names are lower case, as in DeepSpeed: '
        'did you mean "cpu"?')


# ---------------------------------------------------------------------------------------------
# "auto", removed keys, deprecated names
# ---------------------------------------------------------------------------------------------

def test_auto_at_top_level_is_reported_once_and_skips_batch_math() -> None:
    problem = one_problem({TRAIN: "auto", MICRO: 4})
    assert problem.startswith('train_batch_size: "auto" is a placeholder that the Hugging Face integration')
    assert "set a value" in problem


def test_auto_nested_one_problem_per_key() -> None:
    problems = problems_of({TRAIN: 1, "gradient_clipping": "auto",
                            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
                            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": ["auto", 0.99]}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    paths = [p.split(":")[0] for p in problems]
    assert paths == ["gradient_clipping", "zero_optimization.stage3_prefetch_bucket_size",
                     "optimizer.params.lr", "optimizer.params.betas[0]", "scheduler.params.warmup_max_lr"]
    assert all('"auto" is a placeholder' in p for p in problems)


def test_auto_is_a_real_value_for_keep_in_fp32_modules() -> None:
    assert ok({"data_types": {"keep_in_fp32_modules": "auto"}}).data_types.keep_in_fp32_modules == "auto"


@pytest.mark.parametrize("key", ["amp", "nebula", "compression_training", "quantize_training", "sparse_gradients",
                                 "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                                 "curriculum_learning", "progressive_layer_drop"])
def test_removed_top_level_keys(key: str) -> None:
    problem = one_problem({TRAIN: 1, key: {"enabled": True}})
    assert problem.startswith(f"{key}: DeepSpeed 0.19 removed this key (")
    assert "delete" in problem or "instead" in problem


def test_removed_zero_keys() -> None:
    problem = one_problem({TRAIN: 1, "zero_optimization": {"stage": 3, "zeropp_loco_param": 8}})
    assert problem.startswith("zero_optimization.zeropp_loco_param: DeepSpeed 0.19 removed this key (")


@pytest.mark.parametrize("zero,world,message", [
    ({"stage": 2, "mics_shard_size": 2}, 4, "mics_shard_size: 2 partitions ZeRO stage 3 hierarchically; it needs "
                                            "zero_optimization.stage 3 (it is 2)"),
    ({"stage": 3, "zero_hpz_partition_size": 3}, 4, "zero_hpz_partition_size: 3 does not divide the data-parallel "
                                                    "world size (4); use the ranks per node, one of [2, 4]"),
    ({"stage": 3, "mics_shard_size": 8}, 1, "mics_shard_size: 8 does not divide the data-parallel world size (1); "
                                            "use the ranks per node (zerodp config check: give --world-size)"),
    ({"stage": 3, "zero_hpz_partition_size": 2, "mics_shard_size": 2}, 4, "both are set"),
    ({"stage": 3, "mics_shard_size": 1}, 4, "mics_shard_size: 1 would shard over one rank"),
    ({"stage": 3, "mics_shard_size": 2, "offload_param": {"device": "cpu"}}, 4,
     "hierarchical partitioning of offloaded parameters is not implemented"),
    ({"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}, 4,
     "MiCS's two-hop parameter gather is not implemented"),
])
def test_hierarchical_partitioning_is_checked_against_the_stage_and_the_world(zero: dict, world: int,
                                                                               message: str) -> None:
    from zerodp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=world)
    for ok_zero in ({"stage": 3, "mics_shard_size": 2}, {"stage": 3, "zero_hpz_partition_size": 2},
                    {"stage": 3, "mics_shard_size": -1, "zero_hpz_partition_size": 1}):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": ok_zero}, world_size=4)


def test_amp_removal_says_what_to_use() -> None:
    assert 'use "bf16": {"enabled": true}' in one_problem({TRAIN: 1, "amp": {"enabled": True}})


def test_bfloat16_is_the_old_name_of_bf16(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ok({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.precision == "bf16"
    assert "'bfloat16' is deprecated; use 'bf16'" in caplog.text


def test_bfloat16_and_bf16_together_is_a_problem() -> None:
    assert one_problem({TRAIN: 1, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}) == \
        "bfloat16: sets the same option as 'bf16'; keep one"


@pytest.mark.parametrize("value, stage", [(True, 1), (False, 0)])
def test_boolean_zero_optimization(value: bool, stage: int, fresh_warnings: None,
                                   caplog: pytest.LogCaptureFixture) -> None:
    assert ok({"zero_optimization": value}).zero_optimization.stage == stage
    assert '"zero_optimization": true/false is deprecated' in caplog.text


def test_boolean_zero_optimization_reads_allgather_size() -> None:
    assert ok({"zero_optimization": True, "allgather_size": 2e8}).zero_optimization.allgather_bucket_size == 2 * 10**8
    assert one_problem({TRAIN: 1, "zero_optimization": {"stage": 1}, "allgather_size": 2}).startswith(
        'allgather_size: only read with the old form "zero_optimization": true')


def test_top_level_dotted_keys_set_the_nested_key_where_it_is_absent_or_auto(fresh_warnings: None,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    # TRL's prepare_deepspeed passes these to deepspeed.initialize (DeepSpeed ignores them)
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": 7},
           "zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 32 * 32,
           "zero_optimization.stage3_param_persistence_threshold": 320}
    zero = ok(raw).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == (1024, 921)  # 921.6 rounded down
    assert zero.stage3_param_persistence_threshold == 7  # the section's own value wins, with a warning
    assert "'zero_optimization.stage3_param_persistence_threshold' (320) is not applied" in caplog.text
    assert raw["zero_optimization"]["reduce_bucket_size"] == "auto"  # the caller's dict is not changed
    assert one_problem({TRAIN: 1, "zero_optimization.stagee": 2}).startswith("zero_optimization.stagee: unknown key")


def test_cpu_offload_keys_map_to_offload_sections(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    zero = ok({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                     "cpu_offload_use_pin_memory": False}}).zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory is False and zero.offload_param.pin_memory is False
    assert "'zero_optimization.cpu_offload' is deprecated" in caplog.text
    assert "'zero_optimization.cpu_offload_param' is deprecated" in caplog.text
    assert "'zero_optimization.cpu_offload_use_pin_memory' is deprecated" in caplog.text


def test_cpu_offload_false_means_no_offload() -> None:
    assert ok({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization.offload_optimizer is None


def test_cpu_offload_together_with_offload_optimizer_is_a_problem() -> None:
    problem = one_problem({TRAIN: 1, "zero_optimization": {"stage": 2, "cpu_offload": True,
                                                           "offload_optimizer": {"device": "cpu"}}})
    assert problem.startswith("zero_optimization.cpu_offload: deprecated and given together with "
                              "'zero_optimization.offload_optimizer'")


def test_gather_fp16_weights_is_the_old_name(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    zero = ok({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}).zero_optimization
    assert zero.stage3_gather_16bit_weights_on_model_save and zero.gather_16bit_weights_on_model_save
    assert "use 'zero_optimization.stage3_gather_16bit_weights_on_model_save'" in caplog.text


def test_aio_thread_count_is_the_old_name(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    assert ok({"aio": {"thread_count": 4}}).aio.intra_op_parallelism == 4
    assert "'aio.thread_count' is deprecated; use 'aio.intra_op_parallelism'" in caplog.text


@pytest.mark.parametrize("short, long, value", [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 12345),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 77),
    ("model_persistence_threshold", "stage3_model_persistence_threshold", 99),
    ("max_live_parameters", "stage3_max_live_parameters", 1000),
    ("max_reuse_distance", "stage3_max_reuse_distance", 1001),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
    ("module_granularity_threshold", "stage3_module_granularity_threshold", 5),
    ("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", True),
    ("allgather_sequential", "stage3_allgather_sequential", True),
])
def test_stage3_aliases(short: str, long: str, value: object) -> None:
    for key in (short, long):  # stage 2: three of these are refused at non-default values at stage 3
        zero = ok({"zero_optimization": {"stage": 2, key: value}}).zero_optimization
        assert getattr(zero, long) == value and getattr(zero, short) == value
    assert one_problem({TRAIN: 1, "zero_optimization": {short: value, long: value}}) == \
        f"zero_optimization.{long}: sets the same option as 'zero_optimization.{short}'; keep one"


# ---------------------------------------------------------------------------------------------
# Cross-field rules
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled, bf16.enabled: both are true; enable one of them"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio: 0.5 is not supported by zerodp (partial offload (ratio < 1)"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     'zero_optimization.offload_param.nvme_path: required when device is "nvme"'),
    ({"zero_optimization": {"stage": 2}, "gradient_allreduce_op": "sum"},
     'gradient_allreduce_op: "sum" is not supported by zerodp (zerodp averages gradients'),
    ({"zero_optimization": {"stage": 2, "sub_group_size": 0, "offload_optimizer": {"device": "nvme",
                                                                                   "nvme_path": "/tmp"}}},
     "zero_optimization.sub_group_size: 0 is DeepSpeed's one sub-group per parameter, a stage-3 setting"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 0.5}}},
     'optimizer.params.max_grad_norm: not an optimizer parameter; set the top-level "gradient_clipping": 0.5 instead'),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
     "bf16.bf16_optimizer_states: requires bf16.bf16_master_weights_and_grads: true"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads: needs ZeRO stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads: true is not supported by zerodp"),
    ({"zero_optimization": {"stage": 1, "compute_grad_norm": False}},
     "zero_optimization.compute_grad_norm: false is not supported by zerodp (zerodp computes the gradient norm"),
    ({"zero_optimization": {"legacy_stage1": True}},
     "zero_optimization.legacy_stage1: true is not supported by zerodp (DeepSpeed removed"),
])
def test_cross_field_rules(config: dict, expected: str) -> None:
    assert one_problem({TRAIN: 1, **config}).startswith(expected)


def test_cross_field_combinations_that_are_fine() -> None:
    zero = ok({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "ratio": 1}},
               "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
              ).zero_optimization
    assert zero.offload_param.device == "nvme" and zero.offload_optimizer.ratio == 1
    assert ok({"zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}}).zero_optimization.stage == 1


def test_rule_still_runs_when_an_unrelated_key_of_its_section_fails() -> None:
    problems = problems_of({TRAIN: 1, "fp16": {"enabled": True, "hysteresis": 0}, "bf16": {"enabled": True}})
    assert problems == ["fp16.hysteresis: got 0; expected a value >= 1",
                        "fp16.enabled, bf16.enabled: both are true; enable one of them (DeepSpeed refuses this too)"]


# ---------------------------------------------------------------------------------------------
# Features zerodp does not implement: accepted at their defaults, reported otherwise
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, path", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights"),
    ({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}},
     "zero_optimization.mics_hierarchical_params_gather"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
    ({"pipeline": {"stages": 2}}, "pipeline.stages"),
    ({"pipeline": {"activation_checkpoint_interval": 1}}, "pipeline.activation_checkpoint_interval"),
    ({"autotuning": {"enabled": True}}, "autotuning.enabled"),
    ({"tensorboard": {"enabled": True, "output_path": "x"}}, "tensorboard.enabled"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
    ({"seq_parallel_comm_data_type": "bf16"}, "seq_parallel_comm_data_type"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, "checkpoint.parallel_write.pipeline_stage"),
])
def test_unsupported_features_at_non_default_values(config: dict, path: str) -> None:
    problem = one_problem({TRAIN: 1, **config})
    assert problem.startswith(f"{path}: ")
    assert "is not supported by zerodp (" in problem and "; remove it or set " in problem


def test_unsupported_features_accepted_at_defaults() -> None:
    cfg = ok({"zero_optimization": {"stage": 3, "zero_quantized_weights": False, "zero_hpz_partition_size": 1,
                                    "zero_quantized_gradients": False},
              "pipeline": {"stages": "auto", "partition": "best"},
              "autotuning": {"enabled": False, "fast": True}, "wandb": {"enabled": False, "project": "p"},
              "sequence_parallel_size": 1})
    assert cfg.zero_optimization.zero_hpz_partition_size == 1


def test_zeropp_message_says_why() -> None:
    """qwZ and qgZ are built at stage 3 (tests/test_zeropp.py); storing frozen weights quantized is not."""
    assert ok({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}})
    problem = one_problem({TRAIN: 1, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    assert problem == ("zero_optimization.zero_quantized_nontrainable_weights: true is not supported by zerodp "
                       "(storing frozen weights quantized is not implemented; zero_quantized_weights quantizes the "
                       "all-gathers of every weight, frozen ones included, and keeps the shards in the working "
                       "dtype); remove it or set false")


# ---------------------------------------------------------------------------------------------
# optimizer.type and scheduler.type
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Adam", "adamw", "ADAMW", "SGD", "sgd", "Adagrad", "RMSprop", "adamax", "NAdam"])
def test_optimizer_names_accepted(name: str) -> None:
    assert ok({"optimizer": {"type": name, "params": {"lr": 0.01}}}).optimizer.type == name


def test_adam_accepts_deepspeed_extra_params() -> None:
    params = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True,
              "adam_w_mode": False}
    assert ok({"optimizer": {"type": "Adam", "params": params}}).optimizer.params == params


@pytest.mark.parametrize("name", ["Lamb", "Lion", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam"])
def test_deepspeed_only_optimizers_rejected(name: str) -> None:
    problem = one_problem({TRAIN: 1, "optimizer": {"type": name}})
    assert problem.startswith(f'optimizer.type: "{name}" is not supported by zerodp (')
    assert "supported: Adam, AdamW, SGD, Adagrad (case-insensitive), or any torch.optim class (" in problem


def test_adam_bias_correction_false_not_supported() -> None:
    assert ok({"optimizer": {"type": "AdamW", "params": {"bias_correction": True}}}).optimizer.type == "AdamW"
    assert one_problem({TRAIN: 1, "optimizer": {"type": "Adam", "params": {"bias_correction": False}}}) == (
        "optimizer.params.bias_correction: false is not supported by zerodp (torch's Adam and AdamW "
        "always correct bias); remove it or set true")


def test_optimizer_typo_did_you_mean() -> None:
    problem = one_problem({TRAIN: 1, "optimizer": {"type": "AdamWW"}})
    assert problem.startswith('optimizer.type: "AdamWW" is not an optimizer zerodp knows (did you mean \'AdamW\'?)')


def test_optimizer_param_typo() -> None:
    assert one_problem({TRAIN: 1, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}) == \
        "optimizer.params.weight_decy: not a parameter of torch.optim.AdamW; did you mean 'weight_decay'?"


@pytest.mark.parametrize("scheduler", [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}},
    {"type": "CosineAnnealingLR", "params": {"T_max": 100}},
])
def test_scheduler_names_accepted(scheduler: dict) -> None:
    assert ok({"scheduler": scheduler}).scheduler.type == scheduler["type"]


def test_scheduler_typo_did_you_mean() -> None:
    problem = one_problem({TRAIN: 1, "scheduler": {"type": "WarmupLr"}})
    assert problem.startswith('scheduler.type: "WarmupLr" is neither a DeepSpeed scheduler (WarmupLR, '
                              "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) nor a "
                              "torch.optim.lr_scheduler class; did you mean 'WarmupLR'?")


def test_torch_scheduler_missing_required_param() -> None:
    assert one_problem({TRAIN: 1, "scheduler": {"type": "StepLR", "params": {"gamma": 0.5}}}) == \
        "scheduler.params.step_size: missing; torch.optim.lr_scheduler.StepLR requires it"


def test_deepspeed_scheduler_params_checked_against_signature() -> None:
    pytest.importorskip("zerodp.lr_schedules")
    problems = problems_of({TRAIN: 1, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_step": 5}}})
    assert problems == ["scheduler.params.warmup_num_step: not a parameter of WarmupDecayLR; "
                        "did you mean 'warmup_num_steps'?",
                        "scheduler.params.total_num_steps: missing; WarmupDecayLR requires it"]


def test_scheduler_params_come_from_the_config_layer_not_lr_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config is the bottom layer: it checks a DeepSpeed scheduler's params from its own table
    (zerodp.config.schedulers), never from zerodp.lr_schedules, which sits above it."""
    monkeypatch.setitem(sys.modules, "zerodp.lr_schedules", None)  # importing it now raises ImportError
    assert one_problem({TRAIN: 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratioo": 0.1}}}) == \
        "scheduler.params.cos_min_ratioo: not a parameter of WarmupCosineLR; did you mean 'cos_min_ratio'?"
    ok({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}})
    assert one_problem({TRAIN: 1, "scheduler": {"type": "WarmupCosineLR"}}) == \
        "scheduler.params.total_num_steps: missing; WarmupCosineLR requires it"
    assert one_problem({TRAIN: 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}}) == \
        ("scheduler.params.total_num_steps = 9: expected >= warmup_num_steps (1000). Fix: raise total_num_steps "
         "to the number of optimizer steps of the run, or lower warmup_num_steps")


# ---------------------------------------------------------------------------------------------
# Defaults: DeepSpeed 0.19.8's code (reference §1), especially where docs and code disagree
# ---------------------------------------------------------------------------------------------

def test_defaults_that_changed_recently() -> None:
    cfg = ok({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}})
    assert cfg.gradient_clipping == 1.0                                   # v0.19.3, was 0.0
    assert cfg.bf16.check_grad_overflow is True                           # v0.19.3
    assert cfg.zero_optimization.offload_param.pin_memory is True         # v0.19.5
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True     # v0.19.5
    assert cfg.steps_per_print is None                                    # v0.15.2, docs say 10
    assert cfg.aio.intra_op_parallelism == 1                              # renamed from thread_count
    assert cfg.managed_gradient_accumulation is True                      # new in v0.19.4


def test_zero_defaults_where_docs_and_code_disagree() -> None:
    zero = ok({}).zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False                 # docs: false; code: stage 3 only
    assert zero.stage3_prefetch_bucket_size == 50_000_000                 # docs: 5e8
    assert zero.stage3_param_persistence_threshold == 100_000             # docs example: 1e6
    assert zero.sub_group_size == 1_000_000_000                           # docs example: 1e12
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.stage3_max_live_parameters == zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.compute_grad_norm and zero.load_from_fp32_weights and zero.ignore_unused_parameters
    assert zero.offload_param is None and zero.offload_optimizer is None and zero.zenflow is None
    assert ok({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert ok({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_offload_defaults() -> None:
    zero = ok({"zero_optimization": {"stage": 3, "offload_param": {}, "offload_optimizer": {}}}).zero_optimization
    param, opt = zero.offload_param, zero.offload_optimizer
    assert param.device == opt.device == "none" and param.nvme_path is None and opt.nvme_path is None
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    assert (opt.buffer_count, opt.ratio, opt.cpuadam_cores_perc) == (4, 1.0, 0.8)
    assert not (opt.pipeline_read or opt.pipeline_write or opt.fast_init or opt.super_offload)


def test_precision_and_other_section_defaults() -> None:
    cfg = ok({})
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (False, False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    assert fp16.consecutive_hysteresis is False and fp16.fp16_master_weights_and_grads is False
    assert cfg.bf16.enabled is False and cfg.bf16.immediate_grad_update is False  # constants.py says True, unused
    assert cfg.precision == "fp32"
    assert cfg.data_types.grad_accum_dtype is None and cfg.data_types.keep_in_fp32_modules == "auto"
    assert cfg.gradient_allreduce_op == "mean" and cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None and cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.zero_allow_untested_optimizer is False and cfg.optimizer is None and cfg.scheduler is None
    assert cfg.flops_profiler.top_modules == 1 and cfg.flops_profiler.profile_step == 1  # format string says 3
    assert cfg.flops_profiler.module_depth == -1 and cfg.flops_profiler.detailed is True
    assert cfg.comms_logger.prof_all is True and cfg.comms_logger.prof_ops == []
    assert cfg.timers.throughput.enabled and cfg.timers.throughput.synchronized
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.checkpoint.checkpoint_serialization is True
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.overlap_events) == (1_048_576, 8, True)
    assert cfg.activation_checkpointing.number_checkpoints is None
    assert not cfg.activation_checkpointing.partition_activations


@pytest.mark.parametrize("section, precision", [("fp16", "fp16"), ("bf16", "bf16")])
def test_precision_property(section: str, precision: str) -> None:
    assert ok({section: {"enabled": True}}).precision == precision


# ---------------------------------------------------------------------------------------------
# Input forms
# ---------------------------------------------------------------------------------------------

def test_dict_input_is_not_modified() -> None:
    raw = {TRAIN: 2, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    snapshot = json.dumps(raw)
    ok(raw, world_size=2)
    assert json.dumps(raw) == snapshot


def test_path_input(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({MICRO: 2, ACCUM: 3}))
    assert load_config(str(path), world_size=2).train_batch_size == 12
    assert load_config(path, world_size=2).train_batch_size == 12  # os.PathLike


def test_json_string_input() -> None:
    assert load_config('  {"train_micro_batch_size_per_gpu": 2}', world_size=3).train_batch_size == 6


def test_base64_input() -> None:
    encoded = base64.urlsafe_b64encode(json.dumps({MICRO: 2}).encode()).decode()
    assert load_config(encoded, world_size=2).train_batch_size == 4


def test_args_deepspeed_config(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({MICRO: 2}))
    assert load_config(args=argparse.Namespace(deepspeed_config=str(path)), world_size=1).train_batch_size == 2
    assert load_config(args=argparse.Namespace(deepscale_config=str(path)), world_size=1).train_batch_size == 2


def test_config_and_args_both_given_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="a config was passed and args.deepspeed_config is also set"):
        load_config({MICRO: 1}, args=argparse.Namespace(deepspeed_config="ds.json"), world_size=1)


def test_no_config_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no config given"):
        load_config(args=argparse.Namespace(deepspeed_config=None), world_size=1)


def test_duplicate_keys_named(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16,\n'
                    ' "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError) as info:
        load_config(str(path), world_size=1)
    assert info.value.problems == [
        "train_batch_size: duplicate key; only the last value would count, keep one",
        "zero_optimization.stage: duplicate key; only the last value would count, keep one"]


def test_missing_file_named(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: '{missing}'")):
        load_config(missing, world_size=1)
    with pytest.raises(ConfigError, match="config file not found: 'ds_config.json'"):
        load_config("ds_config.json", world_size=1)


def test_invalid_json_located(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8,\n "fp16": {"enabled": true,}}')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* at line 2 column"):
        load_config(str(path), world_size=1)


@pytest.mark.parametrize("config, message", [
    ("[1, 2]", "ignored"),
    (42, "got a int; expected a dict, a path to a JSON file, a JSON string or a ZeroDPConfig"),
])
def test_other_inputs_rejected(tmp_path, config: object, message: str) -> None:
    if isinstance(config, str):
        path = tmp_path / "list.json"
        path.write_text(config)
        config, message = str(path), "the top level must be a JSON object, got [1, 2]"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config, world_size=1)


def test_zerodpconfig_input_round_trips() -> None:
    cfg = load_config({MICRO: 2, "zero_optimization": {"stage": 2}}, world_size=2)
    again = load_config(cfg, world_size=2)
    assert again.model_dump() == cfg.model_dump()
    direct = load_config(ZeroDPConfig(train_micro_batch_size_per_gpu=3), world_size=2)
    assert direct.train_batch_size == 6


def test_unresolved_model_says_how_to_resolve() -> None:
    with pytest.raises(ValueError, match="build it with zerodp.config.load_config"):
        _ = ZeroDPConfig().world_size


# ---------------------------------------------------------------------------------------------
# ConfigError and add_config_arguments
# ---------------------------------------------------------------------------------------------

def test_config_error_shape_and_pickling() -> None:
    err = ConfigError(["a: one", "b: two"], "'ds.json'")
    assert isinstance(err, ValueError)
    assert str(err) == "2 problems in DeepSpeed config 'ds.json':\n  - a: one\n  - b: two"
    assert str(ConfigError("x: y")) == "1 problem in DeepSpeed config:\n  - x: y"
    copy = pickle.loads(pickle.dumps(err))
    assert copy.problems == err.problems and str(copy) == str(err)


def test_add_config_arguments() -> None:
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert args.deepscale is False and args.deepscale_config is None
    old = parser.parse_args(["--deepscale", "--deepscale_config", "old.json"])
    assert old.deepscale is True and old.deepscale_config == "old.json" and old.deepspeed is False
    assert parser.parse_args([]).deepspeed_config is None


def test_offload_param_below_stage_3_has_no_effect_and_says_so(fresh_warnings: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # DeepSpeed ignores it there, and DeepSpeed-Chat sets it with --offload at every stage
    zero = ok({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"},
                                     "offload_optimizer": {"device": "cpu"}}}).zero_optimization
    assert zero.offload_param is None and zero.offload_optimizer.device == "cpu"
    assert ('zero_optimization.offload_param: "device": "nvme" has no effect below ZeRO stage 3 (stage is 2)'
            in caplog.text)


def test_steps_per_print_infinity_means_never() -> None:
    # accelerate writes steps_per_print = float("inf"); json.dumps writes it as Infinity
    assert ok({"steps_per_print": float("inf")}).steps_per_print is None
    assert load_config(json.dumps({TRAIN: 1, "steps_per_print": float("inf")}), world_size=1).steps_per_print is None
    assert one_problem({TRAIN: 1, "steps_per_print": float("-inf")}) == "steps_per_print: got -Infinity; expected an integer"
