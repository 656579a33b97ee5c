"""DeepSpeed ZeRO checkpoints load into zerodp at any world size and stage, bitwise.

The fixtures under tests/fixtures/deepspeed/ were written by real DeepSpeed 0.19.8 on 2 ranks
(make_fixtures.py there says how); each has expected.pt with what DeepSpeed's own consolidation
says every parameter's fp32 master and Adam state are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.fixtures.deepspeed.model import Model, param_groups
from tests.harness import full_state, run_ranks

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (saved at stage S in precision P) -> loaded at (world size, stage): every saved stage and precision,
# every loading stage 0-3, world sizes 1-3 (the fixtures were saved by 2 ranks)
CASES = {"stage1_fp32": (1, 3), "stage1_bf16": (2, 2), "stage1_fp16": (3, 0),
         "stage2_fp32": (2, 3), "stage2_bf16": (1, 1), "stage2_fp16": (2, 0),
         "stage3_fp32": (1, 2), "stage3_bf16": (3, 3), "stage3_fp16": (2, 1)}


def _config(stage: int, precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 10}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}  # not the saved 2**8: the load restores it
    return config


def _engine(stage: int, precision: str):
    import zerodp

    torch.manual_seed(123)  # other initial weights than the saving run's: the load must replace them all
    model = Model()
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=0.01),
                                   config=_config(stage, precision))
    return engine


def _load(rank: int, world: int, cases: list[tuple[str, int]]):
    import zerodp

    results = {}
    for fixture, stage in cases:
        engine = _engine(stage, fixture.split("_")[1])
        path, client_state = engine.load_checkpoint(str(FIXTURES / fixture))
        with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        steps = {float(s["step"]) for s in engine.optimizer.state.values() if "step" in s}
        results[fixture] = {
            "path": path, "client_state": client_state, "state": full_state(engine), "weights": weights,
            "buffer": engine.module.offset.clone(), "lr": engine.get_lr(), "adam_steps": steps,
            "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
            "scheduler": engine.lr_scheduler.state_dict()["last_batch_iteration"],
            "scaler": engine.loss_scaler.state_dict()}
        loss = engine(torch.randn(4, 7).to(DTYPES[fixture.split("_")[1]])).float().pow(2).mean()
        engine.backward(loss)
        engine.step()  # training goes on from the loaded state
        results[fixture]["after_step"] = (engine.global_steps, torch.isfinite(loss).item())
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_deepspeed_checkpoints_load_bitwise(world: int) -> None:
    cases = [(fixture, stage) for fixture, (w, stage) in CASES.items() if w == world]
    loaded = run_ranks(_load, world, args=(cases,))[0]
    for fixture, _ in cases:
        got, expected = loaded[fixture], torch.load(FIXTURES / fixture / "expected.pt", weights_only=True)
        precision = fixture.split("_")[1]
        assert got["path"] == str(FIXTURES / fixture / "global_step3")
        assert got["client_state"] == {"epoch": 7}
        assert got["state"].keys() == expected["params"].keys(), fixture
        for name, tensors in expected["params"].items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got["state"][name][key], tensors[key].reshape(-1)), (fixture, name, key)
            # the working weights are the masters in the working precision, as DeepSpeed's were
            assert torch.equal(got["weights"][name], tensors["master"].to(DTYPES[precision])), (fixture, name)
        assert torch.equal(got["weights"]["gain"], expected["frozen"]["gain"].to(DTYPES[precision])), fixture
        assert torch.equal(got["buffer"], (torch.arange(3, dtype=torch.float32) / 10).to(got["buffer"].dtype))
        assert got["counters"] == (3, 24, 0) == (expected["global_steps"], expected["global_samples"],
                                                 expected["skipped_steps"])
        assert got["adam_steps"] == {3.0}, fixture
        assert got["scheduler"] == 2 and got["lr"] == expected["lr"], fixture
        if precision == "fp16":
            assert (got["scaler"]["loss_scale"], got["scaler"]["cur_iter"]) == (256.0, 3), fixture
        assert got["after_step"] == (4, True), fixture


def test_deepspeeds_16bit_module_weights_are_its_masters_in_16_bits() -> None:
    """What the bitwise test relies on: DeepSpeed's saved 16-bit weights are its fp32 masters cast."""
    from zerodp.checkpoint.deepspeed import load_pickle

    for fixture in ("stage1_bf16", "stage2_fp16"):
        module = load_pickle(FIXTURES / fixture / "global_step3" / "mp_rank_00_model_states.pt")["module"]
        expected = torch.load(FIXTURES / fixture / "expected.pt", weights_only=True)["params"]
        for name, tensors in expected.items():
            assert torch.equal(module[name], tensors["master"].to(module[name].dtype)), (fixture, name)


def _load_converted(rank: int, world: int, root: str, stage: int):
    engine = _engine(stage, "bf16")
    engine.load_checkpoint(root)
    return full_state(engine), engine.global_steps, engine.get_lr()


def test_zerodp_ckpt_convert_from_deepspeed_writes_a_zerodp_checkpoint_and_full_weights(tmp_path: Path) -> None:
    from zerodp.checkpoint import read_safetensors
    from zerodp.cli import main

    expected = torch.load(FIXTURES / "stage3_bf16" / "expected.pt", weights_only=True)
    assert main(["ckpt", "convert", str(FIXTURES / "stage3_bf16"), str(tmp_path / "z"), "--from", "deepspeed",
                 "--to", "zerodp"]) == 0
    assert (tmp_path / "z" / "latest").read_text() == "global_step3"
    assert main(["ckpt", "inspect", str(tmp_path / "z")]) == 0
    state, steps, lr = run_ranks(_load_converted, 2, args=(str(tmp_path / "z"), 1))[0]
    assert (steps, lr) == (3, expected["lr"])
    for name, tensors in expected["params"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], tensors[key].reshape(-1)), (name, key)
    # full weights straight from the DeepSpeed directory (what DeepSpeed's zero_to_fp32.py gives)
    assert main(["ckpt", "convert", str(FIXTURES / "stage2_fp16"), str(tmp_path / "st")]) == 0
    weights = read_safetensors(tmp_path / "st" / "model.safetensors")
    masters = torch.load(FIXTURES / "stage2_fp16" / "expected.pt", weights_only=True)["params"]
    assert all(torch.equal(weights[n], t["master"]) for n, t in masters.items())
    assert torch.equal(weights["gain"], torch.linspace(0.5, 1.5, 5).half()) and "offset" in weights
    # and what a DeepSpeed user calls for the same thing
    from zerodp.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / "stage2_fp16"))
    assert state_dict.keys() == weights.keys() and all(torch.equal(state_dict[n], weights[n]) for n in weights)


@pytest.mark.parametrize("argv, message", [
    (["--to", "zerodp"], "--to zerodp converts a DeepSpeed checkpoint"),
    (["--from", "deepspeed"], "--from deepspeed: "),
])
def test_convert_says_when_the_directory_is_not_what_from_and_to_say(tmp_path: Path, capsys, argv, message) -> None:
    from zerodp.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["ckpt", "convert", str(tmp_path / "empty"), str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class Payload:
    """A class DeepSpeed files never hold: unpickling must refuse it, not build it."""

    def __reduce__(self):
        return (print, ("code from the checkpoint ran",))


def _load_outcome(rank: int, world: int, root: str):
    from zerodp.checkpoint import CheckpointError

    try:
        _engine(2, "fp32").load_checkpoint(root)
    except CheckpointError as err:
        return str(err)
    return None


def test_a_deepspeed_file_holding_other_objects_is_refused_by_name_on_every_rank(tmp_path: Path, capsys) -> None:
    from zerodp.checkpoint.deepspeed import load_pickle

    shutil.copytree(FIXTURES / "stage2_fp32", tmp_path / "c")
    victim = tmp_path / "c" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = load_pickle(victim)
    # zerodp's stand-ins of DeepSpeed's classes would pickle under zerodp's names: plain values instead
    data["optimizer_state_dict"].update(loss_scaler=None, zero_stage=2, param_slice_mappings=None)
    data["extra"] = Payload()
    torch.save(data, victim)
    errors = run_ranks(_load_outcome, 2, args=(str(tmp_path / "c"),))
    for error in errors:
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt holds a pickled builtins.print, which is not among" in error
    assert "code from the checkpoint ran" not in capsys.readouterr().out


def _mismatch(rank: int, world: int, root: str, what: str):
    import zerodp
    from zerodp.checkpoint import CheckpointError

    model = Model()
    if what == "shape":
        model.out = torch.nn.Linear(5, 4)
    groups = param_groups(model) if what != "groups" else [{"params": [p for p in model.parameters() if p.requires_grad]}]
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.01), config=_config(1, "fp32"))
    try:
        engine.load_checkpoint(root)
    except CheckpointError as err:
        return str(err)
    return None


@pytest.mark.parametrize("what, message", [
    ("shape", "size differs for ['out.bias (saved [3], model [4])', 'out.weight (saved [3, 5], model [4, 5])']"),
    ("groups", "holds 2 optimizer param groups but the engine's optimizer has 1"),
])
def test_a_deepspeed_checkpoint_of_another_model_is_refused_by_name(what: str, message: str) -> None:
    errors = run_ranks(_mismatch, 2, args=(str(FIXTURES / "stage1_fp32"), what))
    assert all(message in (e or "") for e in errors), errors
