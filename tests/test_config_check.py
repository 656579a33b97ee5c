"""`zerodp config check` on configs with Hugging Face "auto": filled as the Trainer fills them
(`--hf`, or on its own when "auto" is present), what was filled listed, and an exit code that
reflects only the problems that remain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zerodp.log
from zerodp.cli import main

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
STOCK = sorted(str(p) for p in CONFIGS.glob("*.json") if p.name != "tool_blocks.json")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zerodp.log, "_warned", set())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ZERODP_STRICT_CONFIG", raising=False)


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("path", STOCK, ids=lambda p: Path(p).name)
def test_stock_configs_check_ok_with_auto_detected(path: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "check", path, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('filled "auto" as the Hugging Face Trainer would, at world size 8')
    assert "config OK" in out


def test_the_filled_values_are_listed_with_their_source(capsys: pytest.CaptureFixture) -> None:
    path = str(CONFIGS / "llamafactory_ds_z3_config.json")
    assert main(["config", "check", path, "--world-size", "8", "--hf", "--micro-batch", "4", "--accumulation", "2",
                 "--hidden-size", "1024", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert 'filled "auto" as the Hugging Face Trainer would, at world size 8:\n' in out  # nothing assumed
    for line in ("train_micro_batch_size_per_gpu = 4 (per_device_train_batch_size)",
                 "gradient_accumulation_steps = 2 (gradient_accumulation_steps)",
                 "train_batch_size = 64 (world_size 8 x per_device_train_batch_size 4 x gradient_accumulation_steps 2)",
                 "gradient_clipping = 1.0 (max_grad_norm)",
                 "fp16.enabled = false (--fp16 off)", "bf16.enabled = true (--bf16 on)",
                 "zero_optimization.reduce_bucket_size = 1048576 (hidden_size 1024 ** 2)",
                 "zero_optimization.stage3_prefetch_bucket_size = 943718 (0.9 x hidden_size 1024 ** 2)",
                 "zero_optimization.stage3_param_persistence_threshold = 10240 (10 x hidden_size 1024)"):
        assert f"\n  {line}\n" in out, line
    assert "precision: bf16, ZeRO stage 3" in out


def test_defaults_are_stated_and_taken_from_the_config_where_it_sets_them(capsys: pytest.CaptureFixture) -> None:
    # Axolotl's zero3_bf16 enables bf16 itself: the run must pass --bf16, so that is assumed
    assert main(["config", "check", str(CONFIGS / "axolotl_zero3_bf16.json"), "--world-size", "2"]) == 0
    assert "(assumed: --micro-batch 8, --accumulation 1, --hidden-size 4096, --dtype bf16):" in capsys.readouterr().out


def test_only_real_problems_fail_the_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = json.loads((CONFIGS / "llamafactory_ds_z3_config.json").read_text())
    raw["zero_optimization"]["overlap_comms"] = True
    assert main(["config", "check", _write(tmp_path, raw), "--world-size", "8"]) == 1
    err = capsys.readouterr().err
    assert f"1 problem in DeepSpeed config '{tmp_path / 'ds.json'}':\n" in err
    assert "zero_optimization.overlap_comms: unknown key; did you mean 'overlap_comm'?" in err
    assert '"auto"' not in err


def test_a_value_the_trainer_would_refuse_is_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"})
    assert main(["config", "check", path, "--world-size", "2"]) == 0  # --micro-batch assumed from the config
    capsys.readouterr()
    assert main(["config", "check", path, "--world-size", "2", "--micro-batch", "8"]) == 1
    assert ("train_micro_batch_size_per_gpu: 4, but the Trainer's per_device_train_batch_size gives 8; the Hugging "
            "Face Trainer refuses the mismatch") in capsys.readouterr().err


def test_filling_auto_needs_the_world_size(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = str(CONFIGS / "axolotl_zero2.json")
    assert main(["config", "check", path]) == 1
    assert 'filling "auto" needs the data-parallel world size' in capsys.readouterr().err


def test_without_auto_nothing_is_filled(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                             "data_types": {"keep_in_fp32_modules": "auto"}})  # a DeepSpeed value, not HF's
    assert main(["config", "check", path, "--world-size", "4"]) == 0
    assert "filled" not in capsys.readouterr().out
    assert main(["config", "check", path, "--world-size", "4", "--hf"]) == 0
    assert '  nothing: no key the Trainer fills holds "auto"' in capsys.readouterr().out
