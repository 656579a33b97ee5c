"""DeepSpeed's consolidation step as users run it: the `zero_to_fp32.py` save_checkpoint leaves in the
checkpoint folder, and `python -m deepspeed.utils.zero_to_fp32` under ZERODP_AS_DEEPSPEED=1 (also on
DeepSpeed's own checkpoint folders), each compared bitwise with the engine's full fp32 parameters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.models import batch, make_model

REPO = Path(__file__).resolve().parent.parent
DS_FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "stage2_fp32"


def _train_and_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    import zerodp
    from zerodp.zero.fragments import safe_get_full_fp32_param

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    for step in range(2):
        engine.backward(engine(*batch(rank, step, 0)))
        engine.step()
    engine.save_checkpoint(root)
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("ckpt")
    masters = run_ranks(_train_and_save, 2, args=(str(root),), timeout=120)[0]
    return root, masters


def _run(args: list[str], cwd: Path, switch: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("ZERODP_AS_DEEPSPEED", None)
    if switch:
        env["ZERODP_AS_DEEPSPEED"] = "1"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name


def test_the_script_in_the_checkpoint_folder_consolidates_it(saved, tmp_path: Path) -> None:
    root, masters = saved
    assert (root / "zero_to_fp32.py").read_text().startswith("#!/usr/bin/env python")
    out = _run(["zero_to_fp32.py", ".", str(tmp_path / "out")], cwd=root)  # DeepSpeed's usage, from the folder
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    _equal(state, masters)
    assert torch.equal(state["head.weight"], state["embed.weight"])  # the tied name is there too


def test_python_m_deepspeed_utils_zero_to_fp32_with_deepspeeds_flags(saved, tmp_path: Path) -> None:
    from zerodp.checkpoint.convert import read_safetensors

    root, masters = saved
    out = _run(["-m", "deepspeed.utils.zero_to_fp32", str(root), str(tmp_path / "st"), "--safe_serialization",
                "-t", "global_step2", "--max_shard_size", "10KB"], cwd=tmp_path, switch=True)
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in (tmp_path / "st").iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 2, files  # sharded at 10KB
    state = {}
    for file in files:
        if file.endswith(".safetensors"):
            state.update(read_safetensors(tmp_path / "st" / file))
    _equal(state, masters)


def test_deepspeeds_older_output_file_form(saved, tmp_path: Path) -> None:
    from zerodp.compat.deepspeed.utils.zero_to_fp32 import main

    root, masters = saved
    assert main([str(root), str(tmp_path / "model.bin")]) == 0
    _equal(torch.load(tmp_path / "model.bin", weights_only=True), masters)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]  # no scratch folder left


def test_flags_it_cannot_honour_are_refused_by_name(saved, tmp_path: Path, capsys) -> None:
    from zerodp.compat.deepspeed.utils.zero_to_fp32 import main

    root, _ = saved
    with pytest.raises(SystemExit) as exit_help:
        main(["--help"])
    help_text = capsys.readouterr().out
    assert exit_help.value.code == 0
    for flag in ("checkpoint_dir", "output_dir", "--max_shard_size", "--safe_serialization", "--tag",
                 "--exclude_frozen_parameters", "--debug"):
        assert flag in help_text, flag
    for args, message in (([str(root), str(tmp_path / "o"), "--exclude_frozen_parameters"],
                           "exclude_frozen_parameters=True) is not supported"),
                          ([str(tmp_path / "nowhere"), str(tmp_path / "o")], "nowhere does not exist"),
                          ([str(root), str(tmp_path / "o"), "--max_shard_size", "5 parsecs"], "max_shard_size '5 parsecs'")):
        with pytest.raises(SystemExit) as refused:
            main(args)
        assert refused.value.code == 1 and message in capsys.readouterr().err, args


def test_deepspeeds_own_checkpoint_folder(tmp_path: Path) -> None:
    expected = torch.load(DS_FIXTURE / "expected.pt", weights_only=True)["params"]
    out = _run(["-m", "deepspeed.utils.zero_to_fp32", str(DS_FIXTURE), str(tmp_path / "out")], cwd=tmp_path,
               switch=True)
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    _equal(state, {name: tensors["master"] for name, tensors in expected.items()})
