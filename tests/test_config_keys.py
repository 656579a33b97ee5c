"""No config key is accepted and then ignored (zerodp.config.keys).

The engine runs over a matrix of configs with every read of a config field recorded (reads inside
load_config's own checks do not count); each key the schema accepts must be read there, or be
listed in zerodp.config.keys as not implemented (refused unless at DeepSpeed's default) or as having no
effect in zerodp (warned about) -- and a listed key must behave as listed.
"""

from __future__ import annotations

import typing
from typing import Any

import pytest

import zerodp.log
from tests.harness import run_ranks
from zerodp.config import ConfigError, load_config
from zerodp.config.keys import (
    NO_EFFECT,
    NOT_IMPLEMENTED,
    NOT_IMPLEMENTED_AT_STAGE_3,
    READ_BY_LOAD_CONFIG,
    SWITCHED_SECTIONS,
)
from zerodp.config.schema import Section, ZeroDPConfig

FREE_FORM = {"pipeline", "tensor_parallel", *SWITCHED_SECTIONS}
"""Top-level sections checked as a whole (their switch, or every key against its default)."""


def _schema_paths() -> dict[str, tuple[str, str]]:
    """Every leaf key path of the schema -> (section class name, field name)."""
    out: dict[str, tuple[str, str]] = {}

    def visit(cls: type[Section], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            path = f"{prefix}{name}"
            sub = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                        if isinstance(t, type) and issubclass(t, Section)), None)
            if sub is not None and path not in FREE_FORM:
                visit(sub, path + ".")
            else:
                out[path] = (cls.__name__, name)

    visit(ZeroDPConfig, "")
    return out


def _matrix(nvme: str) -> list[dict]:
    base: list[dict] = [{"zero_optimization": {"stage": s}, **p} for s in range(4)
                        for p in ({}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}})]
    return base + [
        {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                                     "bf16_optimizer_states": True}},
        *({"zero_optimization": {"stage": s, "offload_optimizer": {"device": "cpu"}}} for s in (1, 2, 3)),
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}},
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                               "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                               "stage3_param_persistence_threshold": 0}},
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}},
        {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
        {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "profile": True}},
        {"steps_per_print": 1, "wall_clock_breakdown": True, "memory_breakdown": True, "dump_state": True,
         "log_level": "info", "scheduler": {"type": "WarmupLR", "params": {}}},
        {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
         "optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}}},
        {"flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 1, "top_modules": 2,
                            "detailed": False, "output_file": f"{nvme}/flops.txt"}},
        {"zero_optimization": {"stage": 2}, "torch_autocast": {"enabled": True, "dtype": "bf16",
                                                               "lower_precision_safe_modules": ["torch.nn.Linear"]}},
    ]


def _read_fields(rank: int, world: int, nvme: str) -> set[tuple[str, str]]:
    """(class, field) of every config field the engine reads over the matrix."""
    import torch

    import zerodp
    import zerodp.api
    from tests.models import make_model

    read: set[tuple[str, str]] = set()
    plain = Section.__getattribute__

    def tracking(self, name):
        if name in type(self).model_fields:
            read.add((type(self).__name__, name))
        return plain(self, name)

    def load_untracked(*args, **kwargs):
        Section.__getattribute__ = plain
        try:
            return load_config(*args, **kwargs)
        finally:
            Section.__getattribute__ = tracking

    zerodp.api.load_config = load_untracked
    Section.__getattribute__ = tracking
    try:
        for i, extra in enumerate(_matrix(nvme)):
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
            data = [(torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))) for _ in range(8)]
            engine, _, loader, _ = zerodp.initialize(model=make_model(), config=config, training_data=data)
            for idx, targets in list(loader)[:4]:
                engine.backward(engine(idx, targets))
                engine.step()
            engine.save_checkpoint(f"{nvme}/ckpt{i}")
            engine.load_checkpoint(f"{nvme}/ckpt{i}")
            try:
                engine.save_16bit_model(f"{nvme}/model{i}")
            except RuntimeError:  # stage 3 without stage3_gather_16bit_weights_on_model_save
                pass
            for accessor in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                             "zero_optimization_stage", "gradient_clipping", "steps_per_print", "fp16_enabled",
                             "bfloat16_enabled", "dynamic_loss_scale", "wall_clock_breakdown"):
                getattr(engine, accessor)()
            engine.memory_report()
            engine.comm_report()
    finally:
        Section.__getattribute__ = plain
    return read


def test_every_key_is_read_or_refused_or_warned_about(tmp_path) -> None:
    (read,) = run_ranks(_read_fields, 1, args=(str(tmp_path),), timeout=300)
    paths = _schema_paths()
    read_paths = {path for path, field in paths.items() if field in read}
    listed = {*NOT_IMPLEMENTED, *NOT_IMPLEMENTED_AT_STAGE_3, *NO_EFFECT, *READ_BY_LOAD_CONFIG}
    free_form = {path for path in paths if path.split(".")[0] in FREE_FORM}
    ignored = sorted(set(paths) - read_paths - listed - free_form)
    assert ignored == [], f"accepted, never read and not listed in zerodp/config/keys.py: {ignored}"
    assert sorted(read_paths & set(NO_EFFECT)) == [], "listed as having no effect, but the engine reads them"
    assert sorted(read_paths & set(NOT_IMPLEMENTED)) == [], "listed as not implemented, but the engine reads them"


# Sample values away from DeepSpeed's default, where the default's type does not say one.
_OTHER = {"zero_optimization.zenflow": {}, "checkpoint.writer": {}, "weight_quantization": {},
          "data_types.param_dtype": "fp16", "data_types.buffer_dtype": "fp16", "communication_data_type": "bf16",
          "data_types.keep_in_fp32_modules": ["lm_head"], "gradient_allreduce_op": "sum",
          "seq_parallel_comm_data_type": "fp16", "vocabulary_size": 50257}


def _other_value(path: str, default: Any) -> Any:
    if path in _OTHER:
        return _OTHER[path]
    default = default[0] if isinstance(default, tuple) else default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 2 + 2
    if isinstance(default, float):
        return default / 2 if 0 < default <= 1 else default + 0.5
    raise AssertionError(f"no sample value for {path} (default {default!r}): add one to _OTHER")


def _config_with(path: str, value: Any, stage: int = 2) -> dict:
    config: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if path.startswith("zero_optimization.offload_optimizer."):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if path.startswith("optimizer."):
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


@pytest.mark.parametrize("path", sorted({**NOT_IMPLEMENTED, **NOT_IMPLEMENTED_AT_STAGE_3}))
def test_a_key_not_implemented_is_refused_away_from_its_default(path: str) -> None:
    table = NOT_IMPLEMENTED if path in NOT_IMPLEMENTED else NOT_IMPLEMENTED_AT_STAGE_3
    default, why = table[path]
    load_config(_config_with(path, default[0] if isinstance(default, tuple) else default, stage=3), world_size=1)
    with pytest.raises(ConfigError) as info:
        load_config(_config_with(path, _other_value(path, default), stage=3), world_size=1)
    assert any(p.startswith(f"{path}: ") and "not supported by zerodp" in p and why in p
               for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("section", sorted(SWITCHED_SECTIONS))
def test_a_section_zerodp_does_not_build_is_refused_when_switched_on(section: str) -> None:
    switch, why = SWITCHED_SECTIONS[section]
    with pytest.raises(ConfigError, match=f"{section}.{switch}: true is not supported by zerodp"):
        load_config(_config_with(f"{section}.{switch}", True), world_size=1)


@pytest.mark.parametrize("path", sorted(NO_EFFECT))
def test_a_key_without_effect_is_warned_about_when_set(path: str, monkeypatch, caplog) -> None:
    monkeypatch.setattr(zerodp.log, "_warned", set())
    default, instead = NO_EFFECT[path]
    with caplog.at_level("WARNING", logger="zerodp"):
        for value in default if isinstance(default, tuple) else (default,):  # the default, and what zerodp does
            load_config(_config_with(path, value), world_size=1)
        assert not caplog.records, "no warning at DeepSpeed's default"
        load_config(_config_with(path, _other_value(path, default)), world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: {_show(_other_value(path, default))} has no effect in zerodp ({instead})"]


def _show(value: Any) -> str:
    from zerodp.config.rules import show_value

    return show_value(value)
