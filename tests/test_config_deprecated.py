"""Deprecated zero_optimization keys DeepSpeed 0.19.8 still accepts, when a section is built directly
(`DeepSpeedZeroConfig(**section)` is zerodp's ZeroConfig): mapped as DeepSpeed maps them, one warning
each naming the new key (zerodp/config/deprecated.py). load_config's side is in tests/test_config.py."""

from __future__ import annotations

import pytest

import zerodp.log
from zerodp.config import OffloadOptimizerConfig, ZeroConfig, load_config


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zerodp.log, "_warned", set())


@pytest.mark.parametrize("old, section", [("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")])
def test_cpu_offload_switches_turn_on_the_offload_section(fresh_warnings: None, caplog: pytest.LogCaptureFixture,
                                                          old: str, section: str) -> None:
    zero = ZeroConfig(**{old: True})
    assert getattr(zero, section).device == "cpu"
    assert caplog.text.count(f"'{old}' is deprecated; use '{section}'") == 1
    assert getattr(ZeroConfig(**{old: False}), section) is None


def test_old_and_new_key_together_is_an_error_naming_both() -> None:
    with pytest.raises(ValueError, match="cpu_offload: deprecated and given together with 'offload_optimizer'"):
        ZeroConfig(**{"cpu_offload": True, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ValueError, match="got \"yes\"; expected true or false"):
        ZeroConfig(**{"cpu_offload_param": "yes"})


def test_pin_memory_switch_reaches_the_offload_sections(fresh_warnings: None,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    zero = ZeroConfig(**{"cpu_offload": True, "cpu_offload_use_pin_memory": False})
    assert zero.offload_optimizer.pin_memory is False
    assert "'cpu_offload_use_pin_memory' is deprecated" in caplog.text


def test_renamed_key_works_when_built_directly(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    zero = ZeroConfig(**{"stage3_gather_fp16_weights_on_model_save": True})
    assert zero.gather_16bit_weights_on_model_save is True
    assert "use 'stage3_gather_16bit_weights_on_model_save'" in caplog.text
    with pytest.raises(ValueError, match="deprecated and given together"):
        ZeroConfig(**{"stage3_gather_fp16_weights_on_model_save": True,
                      "stage3_gather_16bit_weights_on_model_save": False})


def test_the_input_dict_is_not_modified() -> None:
    raw = {"cpu_offload": True, "cpu_offload_use_pin_memory": True}
    ZeroConfig(**raw)
    assert raw == {"cpu_offload": True, "cpu_offload_use_pin_memory": True}


@pytest.mark.parametrize("read, write", [(False, False), (True, False), (False, True), (True, True)])
def test_offload_optimizer_pipeline_is_read_or_write(read: bool, write: bool) -> None:
    config = OffloadOptimizerConfig(pipeline_read=read, pipeline_write=write)
    assert config.pipeline is (read or write)
    with pytest.raises(ValueError, match="pipeline"):
        OffloadOptimizerConfig(pipeline=True)  # DeepSpeed 0.19.8 does not accept it as a key either


def test_load_config_and_direct_construction_agree() -> None:
    section = {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": False}
    loaded = load_config({"train_batch_size": 1, "zero_optimization": section}, world_size=1).zero_optimization
    assert loaded.offload_optimizer == ZeroConfig(**section).offload_optimizer
