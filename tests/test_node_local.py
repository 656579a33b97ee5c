"""Node-local checkpoints (checkpoint.use_node_local_storage) on one machine: 4 ranks as 2 hosts of 2.

Each rank says which host it is on as torchrun does (GROUP_RANK) and sees the checkpoint directory as
its host would: a mount namespace of its own with that host's directory bind-mounted there, so the
two hosts' files are apart as on two machines' disks (tests/test_multihost.py does the same across
real hosts). Needs root to make mount namespaces; skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import RankFailed, full_state, run_ranks
from tests.models import make_model, train_steps

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 4096, 16384, 1 << 18


def _why_no_mount_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "mount namespaces need root (CI runs as root)"
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x20000) != 0)"
    if subprocess.run([sys.executable, "-c", probe]).returncode != 0:
        return "unshare(CLONE_NEWNS) is not permitted here"
    return None


pytestmark = pytest.mark.skipif(_why_no_mount_namespaces() is not None,
                                reason=f"node-local checkpoint tests skipped: {_why_no_mount_namespaces()}")


def _be_host(rank: int, ckpt: str, host_dirs: list[str] | None) -> None:
    """Make this rank a process of host rank // 2 whose disk holds host_dirs[rank // 2] at `ckpt`."""
    os.environ["GROUP_RANK"] = str(rank // 2)
    if host_dirs is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs(ckpt, exist_ok=True)
    # private: the bind mount stays in this namespace and never reaches the machine's own
    for ok in (libc.unshare(_CLONE_NEWNS) == 0, libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0,
               libc.mount(host_dirs[rank // 2].encode(), ckpt.encode(), None, _MS_BIND, None) == 0):
        if not ok:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _engine(node_local: bool):
    import zerodp

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "checkpoint": {"use_node_local_storage": node_local}}
    engine, *_ = zerodp.initialize(model=make_model(), config=config)
    return engine


def _save_on_two_hosts(rank: int, world: int, ckpt: str, host_dirs: list[str]) -> dict:
    from zerodp.checkpoint import CheckpointError

    _be_host(rank, ckpt, host_dirs)
    engine = _engine(node_local=True)
    train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt)  # global_step1
    train_steps(engine, rank, range(1, 2))
    engine.save_checkpoint(ckpt)  # global_step2
    saved = full_state(engine)
    after = train_steps(engine, rank, range(2, 4))
    try:
        _engine(node_local=False).save_checkpoint(ckpt, tag="shared")
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return {"saved": saved, "after": after, "refused": refused, "files": sorted(os.listdir(Path(ckpt) / "global_step2")),
            "leftovers": sorted(n for n in os.listdir(ckpt) if n.startswith(".") or n.endswith(".tmp"))}


def _resume(rank: int, world: int, ckpt: str, host_dirs: list[str] | None, stale_latest_on_host_1: bool) -> list:
    _be_host(rank, ckpt, host_dirs)
    if stale_latest_on_host_1 and rank == 2:  # as if host 1 crashed after renaming global_step2, before `latest`
        Path(ckpt, "latest").write_text("global_step1")
    engine = _engine(node_local=True)
    path, _ = engine.load_checkpoint(ckpt)
    return [Path(path).name, engine.global_steps, train_steps(engine, rank, range(engine.global_steps, 4))]


def test_each_host_keeps_its_ranks_files_and_resumes_and_the_hosts_dirs_gather_into_one(tmp_path: Path, capsys) -> None:
    from zerodp.checkpoint import load_state_dict_from_checkpoint
    from zerodp.cli import main

    ckpt, hosts = str(tmp_path / "ckpt"), [str(tmp_path / "host0"), str(tmp_path / "host1")]
    for d in hosts:
        os.makedirs(d)
    saved = run_ranks(_save_on_two_hosts, 4, args=(ckpt, hosts))
    # each host holds its own ranks' files, its engine.pt and meta.json; no probe or TAG.tmp is left
    assert saved[0]["files"] == ["engine.pt", "meta.json", "meta.json.sha256", "rank_0_of_4.pt", "rank_1_of_4.pt", "rng_0.pt", "rng_1.pt"]
    assert saved[2]["files"] == ["engine.pt", "meta.json", "meta.json.sha256", "rank_2_of_4.pt", "rank_3_of_4.pt", "rng_2.pt", "rng_3.pt"]
    assert [s["leftovers"] for s in saved] == [[]] * 4
    # without the key, the save names the host that cannot see rank 0's directory, before writing anything
    for s in saved:
        assert "is not shared by the hosts" in s["refused"] and "#1 (ranks 2-3)" in s["refused"]
        assert "checkpoint.use_node_local_storage: true" in s["refused"]
    assert not any(Path(d, "shared").exists() or Path(d, "shared.tmp").exists() for d in hosts)

    # on the same hosts: resumes exactly, also when host 1's `latest` still names the older tag
    resumed = run_ranks(_resume, 4, args=(ckpt, hosts, True))
    assert [r[:2] for r in resumed] == [["global_step2", 2]] * 4
    assert [r[2] for r in resumed] == [s["after"] for s in saved]

    # on one host that holds half the files: refused on every rank, naming the other host and the remedy
    with pytest.raises(RankFailed, match=r"is not on this host.*#1 \(ranks 2-3\) holds that file.*zerodp ckpt gather"):
        run_ranks(_resume, 4, args=(ckpt, [hosts[0], hosts[0]], False))

    assert main(["ckpt", "inspect", hosts[1]]) == 0
    shown = capsys.readouterr().out
    assert shown.count("node-local: host") == 2
    assert [line.endswith("(on another host)") for line in shown.splitlines() if ".pt " in line] == [
        False, True, True, False, False, True, True, False, False]  # engine, rank_0..3, rng_0..3

    # gathered into one directory: a checkpoint like a shared save's, equal to what was trained
    assert main(["ckpt", "gather", *hosts, "--out", str(tmp_path / "merged")]) == 0
    merged = str(tmp_path / "merged")
    state = load_state_dict_from_checkpoint(merged)
    full = saved[0]["saved"]
    assert set(full) <= set(state)  # and the tied head's alias
    for name, tensors in full.items():
        assert torch.equal(state[name].view(-1), tensors["master"]), name
    again = run_ranks(_resume, 4, args=(merged, None, False))  # no host directories: one shared one
    assert [r[2] for r in again] == [s["after"] for s in saved]
    # a directory is not gathered twice, nor from a save that was not node-local
    assert main(["ckpt", "gather", *hosts, "--out", merged]) == 1
    assert main(["ckpt", "gather", merged, "--out", str(tmp_path / "again")]) == 1


def _save_shared_with_the_key(rank: int, world: int, ckpt: str) -> None:
    _be_host(rank, ckpt, None)  # two hosts by node rank, one directory both see
    engine = _engine(node_local=True)
    train_steps(engine, rank, range(1))
    engine.save_checkpoint(ckpt)


def test_with_the_key_on_a_directory_every_host_shares_the_save_is_an_ordinary_shared_one(tmp_path: Path) -> None:
    import json

    run_ranks(_save_shared_with_the_key, 4, args=(str(tmp_path),))
    meta = json.loads((tmp_path / "global_step1" / "meta.json").read_text())
    assert "nodes" not in meta and meta["global_steps"] == 1
    assert sorted(os.listdir(tmp_path / "global_step1")) == sorted(
        ["engine.pt", "meta.json", "meta.json.sha256", *(f"rank_{r}_of_4.pt" for r in range(4)), *(f"rng_{r}.pt" for r in range(4))])
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "latest", "zero_to_fp32.py"]  # the probes are gone
