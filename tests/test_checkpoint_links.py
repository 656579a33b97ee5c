"""No file written through a link (issue 38): a symbolic link planted at any name zerodp writes in a
checkpoint or output directory (latest.tmp, TAG.tmp, the files inside TAG.tmp, export shards' temporary
names, index and config files) never redirects a write to the file it points to; and an output
directory equal to or inside the checkpoint read is refused. See zerodp/checkpoint/safe_io.py's
[Note: no write through a link]."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.models import train_steps

VICTIM = b"a file outside the checkpoint directory, not zerodp's to write\n"
DS_FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file (in a directory of its own) that the planted links point at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_bytes(VICTIM)
    return outside / "victim.txt"


def _assert_untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    assert os.listdir(victim.parent) == ["victim.txt"]  # nothing written into its directory either


def _plant(directory: Path, names: list[str], target: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).symlink_to(target)


def _engine(stage: int = 1):
    import zerodp
    from tests.models import make_model

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerodp.initialize(model=make_model(), config=config)
    return engine


def _save(rank: int, world: int, root: str, tag: str = "t") -> dict[str, torch.Tensor]:
    """Train a step, save `root/tag`; the trained weights (whole on every rank below stage 3)."""
    engine = _engine()
    train_steps(engine, rank, range(1))
    engine.save_checkpoint(root, tag=tag)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _assert_holds(root: Path, weights: dict[str, torch.Tensor]) -> None:
    """`root`'s latest checkpoint loads and holds exactly `weights`."""
    from zerodp.checkpoint import load_state_dict_from_checkpoint

    state = load_state_dict_from_checkpoint(root)
    assert set(weights) <= set(state)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


# --- save_checkpoint ------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["latest.tmp", "latest", "t.tmp", "t", "t.old"])
def test_a_link_at_a_name_the_save_writes_is_replaced_not_written_through(tmp_path: Path, victim: Path,
                                                                          planted: str) -> None:
    """One rank. A link to the victim file, or (TAG.tmp, TAG) to its directory: the save succeeds, the
    link is gone or replaced, and nothing outside the checkpoint directory changed. (A link at TAG is
    moved aside as an earlier save of the tag would be, and removed, not followed.)"""
    root = tmp_path / "ckpt"
    _plant(root, [planted], victim.parent if planted in ("t.tmp", "t") else victim)
    if planted == "t.old":  # used when the tag is saved again: an earlier t is moved aside there
        (root / "t").mkdir()
    [weights] = run_ranks(_save, 1, args=(str(root),), timeout=120)
    _assert_untouched(victim)
    assert (root / "latest").read_text() == "t" and not (root / "latest").is_symlink()
    assert not (root / "t").is_symlink() and sorted(os.listdir(root)) == ["latest", "t", "zero_to_fp32.py"]
    _assert_holds(root, weights)


def test_links_at_every_file_name_inside_a_stale_tag_tmp_are_not_written_through(tmp_path: Path,
                                                                                  victim: Path) -> None:
    """Two ranks, a TAG.tmp left by a crashed save holding a link at each name the save writes there."""
    root = tmp_path / "ckpt"
    names = ["rank_0_of_2.pt", "rank_1_of_2.pt", "rng_0.pt", "rng_1.pt", "engine.pt", "meta.json", "meta.json.sha256"]
    _plant(root / "t.tmp", names, victim)
    weights = run_ranks(_save, 2, args=(str(root),), timeout=120)
    _assert_untouched(victim)
    assert not any(p.is_symlink() for p in (root / "t").iterdir())
    _assert_holds(root, weights[0])


def _save_16bit(rank: int, world: int, out: str, filename: str) -> dict[str, torch.Tensor]:
    engine = _engine(stage=0)
    train_steps(engine, rank, range(1))
    engine.save_16bit_model(out, filename)
    return {n: t.detach().clone() for n, t in engine.module.state_dict().items()}


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
def test_save_16bit_model_replaces_links_at_its_file_and_temporary_name(tmp_path: Path, victim: Path,
                                                                       filename: str) -> None:
    from zerodp.checkpoint import read_safetensors

    out = tmp_path / "weights"
    _plant(out, [f"{filename}.tmp"], victim)
    (out / filename).symlink_to(victim.parent / "not_there")  # a dangling link at the final name
    [state] = run_ranks(_save_16bit, 1, args=(str(out), filename), timeout=120)
    _assert_untouched(victim)
    assert not (out / filename).is_symlink() and os.listdir(out) == [filename]
    written = (read_safetensors(out / filename) if filename.endswith(".safetensors")
               else torch.load(out / filename, weights_only=True))
    assert written and set(written) <= set(state) and all(torch.equal(t, state[n]) for n, t in written.items())


# --- zerodp ckpt convert ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 2-rank checkpoint (tag t) and its trained weights, shared by the export tests (read only)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    weights = run_ranks(_save, 2, args=(str(root),), timeout=120)[0]
    return root, weights


def _export_names(to: str, tmp_path: Path, saved: tuple[Path, dict]) -> list[str]:
    """The names a conversion writes (run once into a scratch directory)."""
    from zerodp.cli import main

    scratch = tmp_path / "scratch"
    assert main(["ckpt", "convert", str(saved[0]), str(scratch), "--to", to, "--max-shard-size", "1KB"]) == 0
    names = sorted(os.listdir(scratch))
    shutil.rmtree(scratch)
    return names


@pytest.mark.parametrize("to", ["safetensors", "fp32"])
def test_convert_replaces_links_at_every_shard_index_and_config_name(tmp_path: Path, victim: Path, saved,
                                                                    to: str, capsys) -> None:
    """Links at each shard's temporary name, at the index (final and temporary) and at config.json: the
    export is written, complete, and the victim is not."""
    from zerodp.checkpoint import read_safetensors
    from zerodp.cli import main

    names = _export_names(to, tmp_path, saved)
    assert len(names) > 2  # several shards and an index
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "tied-mlp"}))
    out = tmp_path / "out"
    _plant(out, [f"{n}.tmp" for n in names] + [n for n in names if n.endswith(".json")]
           + ["config.json", "config.json.tmp"], victim)
    assert main(["ckpt", "convert", str(saved[0]), str(out), "--to", to, "--max-shard-size", "1KB",
                 "--hf-config", str(hf)]) == 0, capsys.readouterr().err
    _assert_untouched(victim)
    assert sorted(os.listdir(out)) == sorted([*names, "config.json"])
    assert not any(p.is_symlink() for p in out.iterdir())
    assert json.loads((out / "config.json").read_text()) == {"model_type": "tied-mlp"}
    read = read_safetensors if to == "safetensors" else (lambda p: torch.load(p, weights_only=True))
    state = {n: t for f in names if not f.endswith(".json") for n, t in read(out / f).items()}
    assert all(torch.equal(state[n], t) for n, t in saved[1].items())


def test_convert_from_deepspeed_replaces_links_at_latest_tmp_and_tag_tmp(tmp_path: Path, victim: Path) -> None:
    from zerodp.cli import main

    out = tmp_path / "z"
    _plant(out, ["latest.tmp", "zero_to_fp32.py.tmp"], victim)
    _plant(out, ["global_step3.tmp"], victim.parent)
    assert main(["ckpt", "convert", str(DS_FIXTURES / "stage2_fp16"), str(out), "--to", "zerodp"]) == 0
    _assert_untouched(victim)
    assert (out / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(out)) == ["global_step3", "latest", "zero_to_fp32.py"]
    assert not (out / "zero_to_fp32.py").is_symlink()
    assert main(["ckpt", "inspect", str(out)]) == 0


# --- zerodp ckpt gather -----------------------------------------------------------------------------


def _as_node_local(saved_root: Path, hosts_root: Path) -> list[Path]:
    """The 2-rank checkpoint `saved_root` (its latest tag) as a node-local save of two hosts of one rank
    each: each host's directory holds its rank's files and engine.pt, and a meta.json whose `nodes` says so."""
    from zerodp.checkpoint.format import write_meta

    tag = (saved_root / "latest").read_text()
    meta = json.loads((saved_root / tag / "meta.json").read_text())
    own = [[name for name in ("engine.pt", f"rank_{r}_of_2.pt", f"rng_{r}.pt") if name in meta["files"]]
           for r in range(2)]  # a checkpoint converted from DeepSpeed has no rng files
    meta["nodes"] = [{"host": f"h{r}", "ranks": [r], "files": own[r]} for r in range(2)]
    hosts = []
    for node in meta["nodes"]:
        tag_dir = hosts_root / node["host"] / tag
        tag_dir.mkdir(parents=True)
        for name in node["files"]:
            shutil.copyfile(saved_root / tag / name, tag_dir / name)
        write_meta(tag_dir, meta)  # with its checksum, as a node-local save writes it
        (tag_dir.parent / "latest").write_text(tag)
        hosts.append(tag_dir.parent)
    return hosts


@pytest.mark.parametrize("planted", ["latest.tmp", "t.tmp", "files in t.tmp", "zero_to_fp32.py.tmp"])
def test_gather_replaces_links_at_its_temporary_names(tmp_path: Path, victim: Path, saved, planted: str) -> None:
    from zerodp.cli import main

    hosts = _as_node_local(saved[0], tmp_path / "hosts")
    out = tmp_path / "merged"
    if planted == "files in t.tmp":
        _plant(out / "t.tmp", ["engine.pt", "rank_0_of_2.pt", "rank_1_of_2.pt", "rng_1.pt", "meta.json", "meta.json.sha256"],
               victim)
    else:
        _plant(out, [planted], victim.parent if planted == "t.tmp" else victim)
    assert main(["ckpt", "gather", *map(str, hosts), "--out", str(out)]) == 0
    _assert_untouched(victim)
    assert sorted(os.listdir(out)) == ["latest", "t", "zero_to_fp32.py"]
    assert not any(p.is_symlink() for p in (out / "t").iterdir()) and not (out / "zero_to_fp32.py").is_symlink()
    _assert_holds(out, saved[1])


# --- an output inside the input ----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "same through a link", "inside the tag"])
def test_convert_into_the_checkpoint_it_reads_is_refused_naming_both(tmp_path: Path, saved, where: str,
                                                                      capsys) -> None:
    from zerodp.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    (tmp_path / "alias").symlink_to(ckpt)
    out = {"same": ckpt, "inside": ckpt / "hf", "same through a link": tmp_path / "alias",
           "inside the tag": ckpt / "t" / "hf"}[where]
    assert main(["ckpt", "convert", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"OUT {out} (" in err and f"the input checkpoint {ckpt} (" in err, err
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before and not (ckpt / "hf").exists()


def test_an_output_inside_the_input_is_refused_by_gather_and_deepspeed_to_zerodp(tmp_path: Path, saved,
                                                                                  capsys) -> None:
    """Where the output's names are the input's (TAG, latest), also in Python; the weight exports in
    Python write inside a checkpoint directory as DeepSpeed's zero_to_fp32.py does."""
    from zerodp.checkpoint import CheckpointError
    from zerodp.checkpoint.deepspeed import convert_to_zerodp
    from zerodp.cli import main
    from zerodp.compat.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    ds = tmp_path / "ds"
    shutil.copytree(DS_FIXTURES / "stage2_fp16", ds)
    with pytest.raises(CheckpointError, match=r"^the output directory .* is the input checkpoint .*outside it$"):
        convert_to_zerodp(ds, ds)
    with pytest.raises(CheckpointError, match=r"^the output directory .* is inside the input checkpoint"):
        convert_to_zerodp(ds, ds / "z")
    assert not (ds / "z").exists() and sorted(os.listdir(ds)) == ["expected.pt", "global_step3", "latest"]
    assert main(["ckpt", "convert", str(ds), str(ds / "z"), "--to", "zerodp"]) == 2
    assert [p.name for p in convert_zero_checkpoint_to_fp32_state_dict(ds, ds / "fp32")] == ["pytorch_model.bin"]
    hosts = _as_node_local(saved[0], tmp_path / "hosts")
    assert main(["ckpt", "gather", *map(str, hosts), "--out", str(hosts[1] / "merged")]) == 2
    err = capsys.readouterr().err
    assert f"--out {hosts[1] / 'merged'} (" in err and f"is inside the input checkpoint {hosts[1]} (" in err, err
    assert not (hosts[1] / "merged").exists()


# --- the mechanism ------------------------------------------------------------------------------------


def test_format_writers_replace_a_link_and_refuse_none_of_their_own_files(tmp_path: Path, victim: Path) -> None:
    """fsync_write and torch_save_synced, which every checkpoint file goes through, unlink a link at
    their name instead of following it; a directory in the way is an error naming the path."""
    from zerodp.checkpoint.format import fsync_write, torch_save_synced

    _plant(tmp_path / "d", ["a", "b"], victim)
    fsync_write(tmp_path / "d" / "a", b"mine")
    torch_save_synced({"x": torch.ones(2)}, tmp_path / "d" / "b")
    _assert_untouched(victim)
    assert (tmp_path / "d" / "a").read_bytes() == b"mine" and not (tmp_path / "d" / "a").is_symlink()
    assert torch.equal(torch.load(tmp_path / "d" / "b", weights_only=True)["x"], torch.ones(2))
    (tmp_path / "d" / "c").mkdir()
    with pytest.raises(IsADirectoryError, match=r"a directory is in the way.*d/c"):
        fsync_write(tmp_path / "d" / "c", b"mine")


def test_a_write_onto_a_full_disk_names_the_disk_the_bytes_needed_and_free(tmp_path: Path) -> None:
    """A 16 KiB tmpfs: ENOSPC from write or fsync becomes DiskFull, naming the mount and the numbers."""
    from zerodp.checkpoint.format import fsync_write, torch_save_synced
    from zerodp.checkpoint.safe_io import DiskFull

    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    try:
        with pytest.raises(DiskFull, match=rf"^no space left on {mount} \(needed 65,536 bytes, free \d+ bytes\) "
                                           rf"writing {mount}/a"):
            fsync_write(mount / "a", bytes(1 << 16))
        with pytest.raises(DiskFull, match=rf"^no space left on {mount} \(needed 262,144 bytes"):
            torch_save_synced({"x": torch.zeros(1 << 16)}, mount / "b")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
