"""The unknown-key policy (zerodp/config/unknown.py) on the configs LLaMA-Factory and Axolotl ship,
and "auto" filled as the Hugging Face Trainer fills it (zerodp/config/hf_auto.py).

The fixtures in tests/fixtures/configs reproduce the shape of those stock files: LLaMA-Factory's
examples/deepspeed/ds_z{2,3}[_offload]_config.json (every one carries comms_config and
monitor_config, which DeepSpeed ignores), Axolotl's deepspeed_configs/zero3_bf16.json (sub_group_size
0, stage3_max_reuse_distance 0) and zero2.json, and a config with a comment and tool-specific blocks.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import zerodp.log
from zerodp.config import ConfigError, load_config
from zerodp.config.hf_auto import TrainerArgs, fill_hf_auto

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
IGNORED = ("is not one DeepSpeed reads", "(a comment)")
"""The two kinds of warning about an ignored key."""

ARGS = TrainerArgs(world_size=2, micro_batch_size=2, gradient_accumulation_steps=2, hidden_size=64,
                   dtype="bf16", num_training_steps=100)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zerodp.log, "_warned", set())
    monkeypatch.delenv("ZERODP_STRICT_CONFIG", raising=False)


def _raw(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def _ignored_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if any(kind in r.getMessage() for kind in IGNORED)]


@pytest.mark.parametrize("name, ignored", [
    ("llamafactory_ds_z3_config.json", ["comms_config", "monitor_config"]),
    ("llamafactory_ds_z3_offload_config.json", ["comms_config", "monitor_config"]),
    ("llamafactory_ds_z2_config.json", ["comms_config", "monitor_config"]),
    ("axolotl_zero3_bf16.json", []),
    ("axolotl_zero2.json", []),
])
def test_stock_configs_load_with_one_warning_per_ignored_key(name: str, ignored: list[str], fresh_warnings: None,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    filled, _ = fill_hf_auto(_raw(name), ARGS)
    with caplog.at_level("WARNING", logger="zerodp"):
        cfg = load_config(filled, world_size=2)
        load_config(filled, world_size=2)  # a second load (initialize, then the Trainer) warns no more
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    assert cfg.precision == "bf16"
    assert _ignored_warnings(caplog) == [
        f"DeepSpeed config key '{key}' is not one DeepSpeed reads: zerodp ignores it, as DeepSpeed does"
        for key in ignored]


def test_axolotl_zero3_keeps_sub_group_size_and_reuse_distance_0(fresh_warnings: None,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    filled, _ = fill_hf_auto(_raw("axolotl_zero3_bf16.json"), ARGS)
    with caplog.at_level("WARNING", logger="zerodp"):
        zero = load_config(filled, world_size=2).zero_optimization
    assert (zero.sub_group_size, zero.stage3_max_reuse_distance, zero.stage3_max_live_parameters) == (0, 0, 0)
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == (64 * 64, int(0.9 * 64 * 64))
    assert "reuse_distance" not in caplog.text and "sub_group_size" not in caplog.text


@pytest.mark.parametrize("distance", [0, 1e9])
def test_reuse_distance_0_and_the_default_are_accepted_silently(distance: float, fresh_warnings: None,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="zerodp"):
        zero = load_config({"train_micro_batch_size_per_gpu": 1,
                            "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": distance}},
                           world_size=1).zero_optimization
    assert zero.stage3_max_reuse_distance == int(distance) and not caplog.records


def test_comments_and_tool_blocks_are_ignored_with_one_warning_each(fresh_warnings: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="zerodp"):
        cfg = load_config(str(CONFIGS / "tool_blocks.json"), world_size=1)
    assert cfg.zero_optimization.stage == 2
    assert _ignored_warnings(caplog) == [
        "DeepSpeed config key '_comment' starts with '_' (a comment): zerodp ignores it, as DeepSpeed does",
        "DeepSpeed config key 'zero_optimization._comment' starts with '_' (a comment): zerodp ignores it; "
        "DeepSpeed refuses unknown keys inside 'zero_optimization', comments too: remove it before running this "
        "config under DeepSpeed",
        "DeepSpeed config key 'sequence_parallel' is not one DeepSpeed reads: zerodp ignores it, as DeepSpeed does "
        "(if you meant 'sequence_parallel_size', spell it so)",
        "DeepSpeed config key 'fp8' is not one DeepSpeed reads: zerodp ignores it, as DeepSpeed does",
    ]
    assert "comet" not in caplog.text


def test_a_key_deepspeed_ignores_may_hold_auto(fresh_warnings: None) -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "my_tool": {"batch": "auto"}, "_note": "auto"},
                      world_size=1)
    assert cfg.train_batch_size == 1


@pytest.mark.parametrize("config, expected", [
    ({"zero_optimisation": {"stage": 1}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_buket_size": 10}},
     "zero_optimization.stage3_prefetch_buket_size: unknown key; did you mean 'stage3_prefetch_bucket_size'?"),
    ({"gradient_clipin": 1.0}, "gradient_clipin: unknown key; did you mean 'gradient_clipping'?"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation: unknown key; did you mean 'partition_activations'?"),
])
def test_a_typo_stays_an_error_where_deepspeed_would_ignore_it(config: dict, expected: str,
                                                               fresh_warnings: None) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, **config}, world_size=1)
    assert info.value.problems == [expected]


STRICT = 'strict keys are on: "zerodp": {"strict_keys": true} or ZERODP_STRICT_CONFIG=1'


@pytest.mark.parametrize("switch", ["config", "env"])
def test_strict_keys_refuse_every_unknown_key(switch: str, fresh_warnings: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _raw("tool_blocks.json")
    if switch == "config":
        raw["zerodp"] = {"strict_keys": True}
    else:
        monkeypatch.setenv("ZERODP_STRICT_CONFIG", "1")
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=1)
    assert info.value.problems == [
        f"_comment: unknown key, a comment (it starts with '_'); {STRICT}",
        f"zero_optimization._comment: unknown key, a comment (it starts with '_'); {STRICT}",
        f"sequence_parallel: unknown key; did you mean 'sequence_parallel_size'? ({STRICT})",
        f"fp8: unknown key, not a DeepSpeed config key zerodp knows ({STRICT})",
    ]


def test_strict_keys_off_by_default_and_its_own_section_is_checked(fresh_warnings: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "comms_config": {}, "zerodp": {"strict_keys": False}},
                      world_size=1)
    assert cfg.zerodp.strict_keys is False
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "zerodp": {"strict_key": True}}, world_size=1)
    assert info.value.problems == ["zerodp.strict_key: unknown key; did you mean 'strict_keys'?"]
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "zerodp": {"colour_output": True}}, world_size=1)
    assert info.value.problems == ["zerodp.colour_output: unknown key, not a DeepSpeed config key zerodp knows "
                                   "('zerodp' is zerodp's own section: every key in it is checked)"]
    monkeypatch.setenv("ZERODP_STRICT_CONFIG", "yes")
    with pytest.raises(ConfigError, match=r"\$ZERODP_STRICT_CONFIG: got 'yes'; expected 1"):
        load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)


def test_stage3_auto_below_stage_3_is_dropped_as_deepspeed_does(fresh_warnings: None) -> None:
    # the Trainer fills these two at stage 3 only; DeepSpeed drops the "auto" left below it
    zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}},
        world_size=1).zero_optimization
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    with pytest.raises(ConfigError, match='zero_optimization.stage3_prefetch_bucket_size: "auto" is a placeholder'):
        load_config({"train_micro_batch_size_per_gpu": 1,
                     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}, world_size=1)


def test_sub_group_size_0_is_accepted_where_deepspeed_gives_it_a_meaning(fresh_warnings: None) -> None:
    for zero in ({"stage": 3, "sub_group_size": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
                 {"stage": 2, "sub_group_size": 0, "offload_optimizer": {"device": "cpu"}}):
        assert load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero},
                           world_size=1).zero_optimization.sub_group_size == 0


# ---------------------------------------------------------------------------------------------
# "auto" filled as transformers' HfTrainerDeepSpeedConfig fills it
# ---------------------------------------------------------------------------------------------

def _trainer_fill(raw: dict, args: TrainerArgs) -> dict:
    """transformers' own HfTrainerDeepSpeedConfig run on `raw` (its deepspeed version check skipped)."""
    deepspeed_integration = pytest.importorskip("transformers.integrations.deepspeed")
    accelerate_deepspeed = pytest.importorskip("accelerate.utils.deepspeed")
    cls = type("Trainer", (deepspeed_integration.HfTrainerDeepSpeedConfig, accelerate_deepspeed.HfDeepSpeedConfig), {})
    hf = cls.__new__(cls)
    accelerate_deepspeed.HfDeepSpeedConfig.__init__(hf, json.loads(json.dumps(raw)))
    hf._dtype, hf.mismatches = None, []
    training_args = SimpleNamespace(
        world_size=args.world_size, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
        learning_rate=args.learning_rate, adam_beta1=args.adam_betas[0], adam_beta2=args.adam_betas[1],
        adam_epsilon=args.adam_epsilon, weight_decay=args.weight_decay, save_on_each_node=False,
        fp16=args.dtype == "fp16", fp16_full_eval=False, bf16=args.dtype == "bf16", bf16_full_eval=False,
        get_warmup_steps=lambda steps: args.warmup_steps)
    hf.trainer_config_process(training_args)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=args.hidden_size))
    hf.trainer_config_finalize(training_args, model, args.num_training_steps)
    return hf.config


OPTIMIZER_AND_SCHEDULER = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json") if p.name != "tool_blocks.json"))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_auto_is_filled_as_the_trainer_fills_it(name: str, dtype: str) -> None:
    raw = {**_raw(name), **OPTIMIZER_AND_SCHEDULER}
    args = TrainerArgs(world_size=4, micro_batch_size=3, gradient_accumulation_steps=5, hidden_size=48,
                       dtype=dtype, num_training_steps=70, warmup_steps=7)
    if dtype != "bf16" and raw.get("bf16", {}).get("enabled") is True:
        pytest.skip("the Trainer refuses a config whose bf16.enabled differs from --bf16")
    filled, notes = fill_hf_auto(raw, args)
    assert filled == _trainer_fill(raw, args)
    assert notes and all(n.path and n.source for n in notes)


# ---------------------------------------------------------------------------------------------
# The stock configs train
# ---------------------------------------------------------------------------------------------

def _train_each(rank: int, world_size: int, configs: list[dict]) -> list[list[float]]:
    """Losses of 2 steps (2 micro-batches each) per config, on a tiny model."""
    import torch

    import zerodp
    from tests.models import make_model

    losses = []
    for config in configs:
        data = [(torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))) for _ in range(16)]
        engine, _, loader, _ = zerodp.initialize(model=make_model(), config=config, training_data=data)
        steps = []
        for idx, targets in list(loader)[:4]:
            loss = engine(idx, targets)
            engine.backward(loss)
            engine.step()
            steps.append(float(loss))
        losses.append(steps)
    return losses


def test_stock_configs_train_a_tiny_model_at_two_ranks(fresh_warnings: None) -> None:
    from tests.harness import run_ranks

    names = sorted(p.name for p in CONFIGS.glob("*.json") if p.name != "tool_blocks.json")
    optimizer = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # the Trainer would pass its own
    configs = [{**fill_hf_auto(_raw(name), ARGS)[0], **optimizer} for name in names]
    losses = run_ranks(_train_each, 2, args=(configs,), timeout=300)
    for rank_losses in losses:  # each rank's own micro-batches
        for name, per_config in zip(names, rank_losses):
            assert len(per_config) == 4 and all(math.isfinite(loss) for loss in per_config), (name, per_config)


def test_a_script_optimizer_beside_a_config_optimizer_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """Both given: the script's wins (as on DeepSpeed, which logs that it uses the client optimizer), and
    the user is told the config's section is ignored, once."""
    import torch

    from zerodp.api import _optimizer_maker
    from zerodp.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                      world_size=1)
    caplog.set_level(logging.WARNING, logger="zerodp")
    param = torch.nn.Parameter(torch.ones(2))
    made = _optimizer_maker(lambda groups: torch.optim.SGD(groups, lr=0.5), cfg, torch.device("cpu"), None)
    assert isinstance(made([{"params": [param]}]), torch.optim.SGD)
    said = [r.getMessage() for r in caplog.records if "the config's is ignored" in r.getMessage()]
    assert said == ["initialize(optimizer=...) was given and the config has an optimizer section (AdamW): the "
                    "script's optimizer is used, the config's is ignored"]
