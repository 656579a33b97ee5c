"""Optimizer and scheduler parameters (zerodp.config.hparams), and the limits load_config puts on
absurd input: every value `zerodp config check` accepts must train, and both entry points say the
same thing about every value they refuse."""

from __future__ import annotations

import concurrent.futures
import json
import math

import pytest

from tests.harness import run_ranks
from zerodp.cli import main
from zerodp.config import ConfigError, load_config
from zerodp.config.hparams import Spec, spec_from_annotation

TRAIN = "train_batch_size"

# The values the fault battery found accepted and then failing or training on garbage (issue 12),
# applied to every parameter of the optimizers and schedulers below.
_BAD_VALUES = ["0.001", True, None, [0.1], -1.0, math.inf, -math.inf, math.nan, "0.9,0.95", {"a": 1}]

_OPTIMIZERS = {
    "AdamW": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False},
    "Adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True,
             "torch_adam": False},
    "SGD": {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "Adagrad": {"lr": 0.01, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
    "RMSprop": {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "momentum": 0.0, "centered": False},
}
_SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"},
    "WarmupDecayLR": {"total_num_steps": 100, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
    "WarmupCosineLR": {"total_num_steps": 100, "warmup_min_ratio": 0.0, "warmup_num_steps": 10, "cos_min_ratio": 1e-4},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10, "cycle_min_mom": 0.8,
                 "cycle_max_mom": 0.9},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 1.0},
    "StepLR": {"step_size": 10, "gamma": 0.5},
    "CosineAnnealingLR": {"T_max": 100, "eta_min": 0.0},
}


def _config(optimizer: tuple[str, dict], scheduler: tuple[str, dict] | None = None) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": optimizer[0], "params": optimizer[1]}}
    if scheduler is not None:
        config["scheduler"] = {"type": scheduler[0], "params": scheduler[1]}
    return config


def _mutations() -> list[tuple[str, dict]]:
    """(label, config) for one bad value in one parameter, over every parameter above."""
    out = []
    for name, params in _OPTIMIZERS.items():
        for key in params:
            for value in _BAD_VALUES:
                out.append((f"{name}.{key}={value!r}", _config((name, {**params, key: value}))))
    for name, params in _SCHEDULERS.items():
        for key in params:
            for value in _BAD_VALUES:
                out.append((f"{name}.{key}={value!r}", _config(("AdamW", {"lr": 1e-3}), (name, {**params, key: value}))))
    return out


def _refused(config: dict) -> list[str] | None:
    try:
        load_config(config, world_size=1)
    except ConfigError as err:
        return err.problems
    return None


def test_every_valid_example_is_accepted() -> None:
    for name, params in _OPTIMIZERS.items():
        assert _refused(_config((name, params))) is None, name
    for name, params in _SCHEDULERS.items():
        assert _refused(_config(("AdamW", {"lr": 1e-3}), (name, params))) is None, name


@pytest.mark.parametrize("label,value,expected", [
    ("lr", "0.001", 'optimizer.params.lr: got "0.001"; expected a finite number >= 0 (a JSON number: write it '
                    "without quotes)"),
    ("lr", True, "optimizer.params.lr: got true; expected a finite number >= 0"),
    ("lr", math.inf, "optimizer.params.lr: got Infinity; expected a finite number >= 0"),
    ("weight_decay", math.inf, "optimizer.params.weight_decay: got Infinity; expected a finite number >= 0"),
    ("eps", None, "optimizer.params.eps: got null; expected a finite number >= 0"),
    ("betas", "0.9,0.95", 'optimizer.params.betas: got "0.9,0.95"; expected a list of 2 (a finite number in [0, 1), '
                          "a finite number in [0, 1))"),
    ("betas", [0.9, 1.0], "optimizer.params.betas: got [0.9, 1.0]; expected a list of 2"),
    ("weight_decay", -0.1, "optimizer.params.weight_decay: got -0.1; expected a finite number >= 0"),
    ("lr", [1e-3], "optimizer.params.lr: got [0.001]; expected a finite number >= 0"),
])
def test_the_values_the_fault_battery_found_are_named_with_their_key(label: str, value: object, expected: str) -> None:
    problems = _refused(_config(("AdamW", {**_OPTIMIZERS["AdamW"], label: value})))
    assert problems is not None and len(problems) == 1 and problems[0].startswith(expected), problems


def test_1e999_in_json_text_is_infinity_and_refused() -> None:
    text = json.dumps(_config(("AdamW", {"lr": 1e-3}))).replace("0.001", "1e999")
    with pytest.raises(ConfigError, match=r"optimizer.params.lr: got Infinity"):
        load_config(text, world_size=1)


def test_what_torch_itself_refuses_is_found_before_any_rank_starts() -> None:
    problems = _refused(_config(("SGD", {"lr": 0.1, "nesterov": True})))
    assert problems == ["optimizer.params: torch.optim.SGD refuses these values: Nesterov momentum requires a "
                        "momentum and zero dampening"]
    problems = _refused(_config(("AdamW", {"lr": 1e-3}), ("WarmupLR", {"warmup_min_lr": 0.01})))
    assert problems == ["scheduler.params.warmup_min_lr = 0.01: expected <= the optimizer's lr (0.001). "
                        "Fix: lower warmup_min_lr or raise the optimizer's lr"]


def test_a_schedule_is_not_checked_against_an_lr_the_config_does_not_know() -> None:
    """The optimizer may be passed to initialize (no "optimizer" section): its lr is unknown here."""
    config = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01}}}
    assert load_config(config, world_size=1).scheduler.params == {"warmup_min_lr": 0.01}


def test_config_check_and_initialize_say_the_same_about_every_refused_value(tmp_path, capsys) -> None:
    """One validation path: the CLI's message is initialize's, for each refused mutation."""
    import zerodp
    from tests.models import make_model

    refused = [(label, config, problems) for label, config in _mutations()
               if (problems := _refused(config)) is not None]
    assert len(refused) > 200
    for label, config, problems in refused[::23]:  # a spread of them: initialize is slower than a check
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config, allow_nan=True))
        assert main(["config", "check", str(path), "--world-size", "1"]) == 1, label
        assert all(p in capsys.readouterr().err for p in problems), label
        with pytest.raises(ConfigError) as info:
            zerodp.initialize(model=make_model(), config=config)
        assert info.value.problems == problems, label


def _train_each(rank: int, world: int, configs: list[tuple[str, dict]]) -> list[str]:
    """Labels of the configs that failed to initialize, or trained to a non-finite parameter."""
    import torch

    import zerodp
    from tests.models import batch, make_model

    bad = []
    for label, config in configs:
        try:
            engine, *_ = zerodp.initialize(model=make_model(), config=config)
            for step in range(3):
                engine.backward(engine(*batch(rank, step, 0)))
                engine.step()
            if not all(torch.isfinite(p).all() for p in engine.module.parameters()):
                bad.append(f"{label}: non-finite parameters")
        except Exception as err:  # noqa: BLE001 - each failure is reported by its label
            bad.append(f"{label}: {type(err).__name__}: {err}")
    return bad


def test_every_value_config_check_accepts_trains_to_finite_parameters() -> None:
    accepted = [(label, config) for label, config in _mutations() if _refused(config) is None]
    assert accepted, "the battery has no accepted mutation (say, SGD dampening -1): it tests nothing"
    assert run_ranks(_train_each, 1, args=(accepted,), timeout=300) == [[]]


# ---------------------------------------------------------------------------------------------
# Specs from torch's annotations
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("annotation,good,bad", [
    ("float | Tensor", [0.5, 1], ["1", True, None, math.nan]),
    ("int | None", [3, None], [3.5, "3"]),
    ("tuple[float | None, float]", [[None, 1e-3]], [[1e-3], "x"]),
    ("float | list[float]", [0.1, [0.1, 0.2]], [[0.1, "x"]]),
    ("bool | None", [True, None], [0]),
])
def test_specs_follow_torch_annotations(annotation: str, good: list, bad: list) -> None:
    spec = spec_from_annotation(annotation)
    assert all(spec.accepts(v) for v in good), spec.describe()
    assert not any(spec.accepts(v) for v in bad), spec.describe()


def test_spec_descriptions_read_as_sentences() -> None:
    assert Spec("integer", low=1).describe() == "an integer >= 1"
    assert Spec("number", low=0, high=1, high_open=True).describe() == "a finite number in [0, 1)"


# ---------------------------------------------------------------------------------------------
# Absurd input: refused at once, by name
# ---------------------------------------------------------------------------------------------

def _finishes(fn, *args):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=60)  # it hung before (a scan of range(1, micro))


def test_an_absurd_batch_size_is_refused_and_does_not_hang() -> None:
    problems = _finishes(_refused, {TRAIN: 1e30, "train_micro_batch_size_per_gpu": 1e15})
    assert problems == [
        "train_batch_size: got 1,000,000,000,000,000,019,884,624,838,656; expected at most 1,000,000,000 samples "
        "(is it a token count, or a typo?)",
        "train_micro_batch_size_per_gpu: got 1,000,000,000,000,000; expected at most 1,000,000,000 samples "
        "(is it a token count, or a typo?)"]


def test_choices_for_a_large_prime_batch_come_from_divisor_pairs() -> None:
    problems = _finishes(_refused, {TRAIN: 999_999_937, "train_micro_batch_size_per_gpu": 100_000})
    assert "train_micro_batch_size_per_gpu=1 with gradient_accumulation_steps=999999937" in problems[0]


@pytest.mark.parametrize("as_text", [True, False])
def test_a_deeply_nested_config_is_a_clear_error(as_text: bool) -> None:
    deep: object = []
    for _ in range(100_000):
        deep = [deep]
    config = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}" if as_text else {"a": deep}
    with pytest.raises(ConfigError, match=r"nested (too deeply to parse|more than 64 levels deep)"):
        load_config(config, world_size=1)
