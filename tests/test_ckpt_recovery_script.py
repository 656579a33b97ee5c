"""The checkpoint folders that zerodp's own commands write get the `zero_to_fp32.py` a save leaves
(zerodp/checkpoint/recovery_script.py): `zerodp ckpt convert --to zerodp` (a DeepSpeed checkpoint as a
zerodp one) and `zerodp ckpt gather` (a node-local save's hosts' directories as one). Running that
script as a user does, with this Python, gives the consolidation of the source checkpoint, bitwise;
`zerodp ckpt convert --to safetensors|fp32` writes weights, not a checkpoint, and gets no script."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.test_checkpoint_links import _as_node_local
from tests.test_zero_to_fp32 import _run  # python ARGS with this checkout's zerodp, the switch on or off

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "stage3_bf16"  # real DeepSpeed 0.19.8, 2 ranks


def _consolidated_by_the_folders_script(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """`python FOLDER/zero_to_fp32.py FOLDER OUT`, as DeepSpeed's users run it; OUT's weights."""
    done = _run([str(folder / "zero_to_fp32.py"), str(folder), str(out)], cwd=folder.parent)
    assert done.returncode == 0, done.stderr
    return torch.load(out / "pytorch_model.bin", weights_only=True)


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _source_consolidation() -> dict[str, torch.Tensor]:
    """The DeepSpeed checkpoint's fp32 weights, read straight from its folder; checked against the
    masters DeepSpeed's own consolidation recorded in expected.pt."""
    from zerodp.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURE))
    for name, tensors in torch.load(FIXTURE / "expected.pt", weights_only=True)["params"].items():
        assert torch.equal(state[name], tensors["master"]), name
    return state


def test_a_deepspeed_checkpoint_converted_to_zerodp_carries_the_script(tmp_path: Path, capsys) -> None:
    from zerodp.cli import main

    out = tmp_path / "z"
    assert main(["ckpt", "convert", str(FIXTURE), str(out), "--from", "deepspeed", "--to", "zerodp"]) == 0
    assert str(out / "zero_to_fp32.py") in capsys.readouterr().out.splitlines()  # listed with the files written
    source = _source_consolidation()
    _assert_equal(_consolidated_by_the_folders_script(out, tmp_path / "by_script"), source)
    # and DeepSpeed's module form under the switch, on the converted folder
    done = _run(["-m", "deepspeed.utils.zero_to_fp32", str(out), str(tmp_path / "by_module")], cwd=tmp_path,
                   switch=True)
    assert done.returncode == 0, done.stderr
    _assert_equal(torch.load(tmp_path / "by_module" / "pytorch_model.bin", weights_only=True), source)
    # full weights are not a checkpoint folder: no script there
    assert main(["ckpt", "convert", str(out), str(tmp_path / "st")]) == 0
    assert not (tmp_path / "st" / "zero_to_fp32.py").exists()


def test_a_gathered_node_local_checkpoint_carries_the_script(tmp_path: Path) -> None:
    from zerodp.cli import main

    assert main(["ckpt", "convert", str(FIXTURE), str(tmp_path / "z"), "--from", "deepspeed", "--to", "zerodp"]) == 0
    hosts = _as_node_local(tmp_path / "z", tmp_path / "hosts")  # two hosts of one rank each
    assert not any((host / "zero_to_fp32.py").exists() for host in hosts)
    merged = tmp_path / "merged"
    assert main(["ckpt", "gather", *map(str, hosts), "--out", str(merged)]) == 0
    assert sorted(p.name for p in merged.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py"]
    _assert_equal(_consolidated_by_the_folders_script(merged, tmp_path / "by_script"), _source_consolidation())
