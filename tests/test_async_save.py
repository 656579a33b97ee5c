"""Async checkpoint saves (zerodp/checkpoint/async_save.py): the same checkpoint as a sync save, the
state of the moment of the call whatever training does next, a failed background write raised on
every rank, a kill -9 mid-write that leaves the previous checkpoint loadable, a commit at exit."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.harness import RankFailed, full_state, run_ranks
from tests.test_checkpoints import _engine, _outcome, _params, _train, full_disk  # noqa: F401 - a fixture

CONFIGS = {
    "stage0": {"zero_optimization": {"stage": 0}},
    "stage1": {"zero_optimization": {"stage": 1}},
    "stage3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}},
    "stage2-cpu-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
}


def _save_both_ways(rank: int, world: int, config: dict, root: str):
    """3 steps, a sync save and an async one of the same state, 2 more steps while it is written."""
    engine = _engine(0, config)
    _train(engine, rank, range(3))
    rng = torch.get_rng_state()
    engine.save_checkpoint(os.path.join(root, "sync"), client_state={"epoch": 7})
    torch.set_rng_state(rng)  # the async save records the same RNG state
    engine.save_checkpoint(os.path.join(root, "async"), client_state={"epoch": 7}, async_save=True)
    in_flight = engine.async_saves.in_flight
    _train(engine, rank, range(3, 5))  # training continues; a boundary may publish it
    engine.wait_for_checkpoint()
    return in_flight, not engine.async_saves.in_flight


def _resume(rank: int, world: int, config: dict, path: str):
    engine = _engine(0, config)
    _, client_state = engine.load_checkpoint(path)
    return _train(engine, rank, range(3, 6)), _params(engine), engine.get_lr(), client_state, engine.global_steps


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_async_save_resumes_bitwise_like_a_sync_save(tmp_path: Path, name: str) -> None:
    for in_flight, published in run_ranks(_save_both_ways, 2, args=(CONFIGS[name], str(tmp_path))):
        assert in_flight and published
    sync = run_ranks(_resume, 2, args=(CONFIGS[name], str(tmp_path / "sync")))
    from_async = run_ranks(_resume, 2, args=(CONFIGS[name], str(tmp_path / "async")))
    for (record, params, lr, client, steps), (record2, params2, lr2, client2, steps2) in zip(sync, from_async):
        assert record == record2 and lr == lr2 and client == client2 == {"epoch": 7} and steps == steps2 == 6
        assert all(torch.equal(a, b) for a, b in zip(params, params2))
    assert (tmp_path / "async" / "latest").read_text() == "global_step3"
    assert not list((tmp_path / "async").glob("*.tmp"))


def _hold_the_writer(rank: int):
    """Make this rank's writer thread wait at its first file until the returned event is set."""
    from zerodp.checkpoint import save as save_module

    gate, write = threading.Event(), save_module.torch_save_synced

    def held(obj, path):
        if threading.current_thread() is not threading.main_thread():
            gate.wait(60)
        return write(obj, path)

    save_module.torch_save_synced = held
    return gate


def _save_then_change_everything(rank: int, world: int, root: str):
    """The async save returns while its writer is held; the masters, the optimizer state, the buffers'
    owner (the module) and client_state change, 2 steps run; the checkpoint holds the old values."""
    engine = _engine(1, {"checkpoint": {"async_save": True}})  # async from the config
    _train(engine, rank, range(2))
    before = full_state(engine)
    client_state = {"note": [1, 2], "t": torch.ones(3)}
    gate = _hold_the_writer(rank)
    engine.save_checkpoint(root, tag="held", client_state=client_state)
    published_early = (Path(root) / "latest").exists()
    for piece in engine.strategy.pieces(saving=True):  # the very tensors the save copied
        for t in piece.tensors.values():
            t.add_(1.0)
    client_state["note"].append(3)
    client_state["t"].add_(1)
    _train(engine, rank, range(2, 4))
    changed = full_state(engine)
    gate.set()
    path, loaded_client = engine.load_checkpoint(root)  # waits for the save in flight, then loads it
    loaded = full_state(engine)
    same = all(torch.equal(loaded[n][k], before[n][k]) for n in before for k in before[n])
    differs = any(not torch.equal(changed[n][k], before[n][k]) for n in before for k in before[n])
    return published_early, path, same, differs, loaded_client["note"], loaded_client["t"].tolist(), engine.global_steps


def test_what_an_async_save_writes_is_the_state_when_it_was_called(tmp_path: Path) -> None:
    for published_early, path, same, differs, note, t, steps in run_ranks(_save_then_change_everything, 2,
                                                                           args=(str(tmp_path),), timeout=120):
        assert not published_early  # the call returned while the writer was still held
        assert path.endswith("held") and differs and same
        assert note == [1, 2] and t == [1.0, 1.0, 1.0] and steps == 2


def _write_fails_on_rank_1(rank: int, world: int, root: str, full: str, how: str, where: str):
    from zerodp.checkpoint import save as save_module

    engine = _engine(1)
    _train(engine, rank, range(1))
    engine.save_checkpoint(root, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    write = save_module.torch_save_synced
    if rank == 1 and how == "full disk":  # a real full disk (tmpfs of 16 KiB) under rank 1's shard
        save_module.torch_save_synced = lambda obj, path: write(obj, Path(full) / path.name)
    elif rank == 1:
        def failing(obj, path):
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        save_module.torch_save_synced = failing
    engine.save_checkpoint(root, tag="bad", async_save=True)  # returns: the write fails in the background

    def next_steps() -> None:
        for step in range(1, 60):
            _train(engine, rank, range(step, step + 1))  # each boundary polls the writers
            time.sleep(0.05)

    return _outcome(next_steps if where == "step" else engine.wait_for_checkpoint), engine.async_saves.in_flight


@pytest.mark.parametrize("how,where", [("injected", "step"), ("injected", "wait"), ("full disk", "wait")])
def test_a_failed_background_write_is_raised_on_every_rank(tmp_path: Path, how: str, where: str, request) -> None:
    full = request.getfixturevalue("full_disk") if how == "full disk" else tmp_path
    root = tmp_path / "ckpt"
    ((kind0, text0), left0), ((kind1, text1), left1) = run_ranks(
        _write_fails_on_rank_1, 2, args=(str(root), str(full), how, where), timeout=120)
    expected = "DiskFull" if how == "full disk" else "OSError"
    assert kind1 == expected and (kind0, text0.split(":")[0]) == ("PeerFailed", f"rank 1 failed with {expected}")
    assert not left0 and not left1
    assert (root / "latest").read_text() == "good"
    assert not (root / "bad").exists() and not (root / "bad.tmp").exists()


def _async_save_then_crash(rank: int, world: int, root: str, where: str):
    from zerodp.checkpoint import save as save_module

    engine = _engine(1, {"checkpoint": {"async_save": True}})
    _train(engine, rank, range(1))
    engine.save_checkpoint(root, tag="good")
    _train(engine, rank, range(1, 2))
    engine.wait_for_checkpoint()  # "good" is published (its writer must not meet the crash below)
    original = getattr(save_module, where)

    def crash(*args, **kwargs):
        if rank == (1 if where == "torch_save_synced" else 0):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: in the writer thread, or in the commit's rename
        return original(*args, **kwargs)

    setattr(save_module, where, crash)
    engine.save_checkpoint(root, tag="bad")
    _train(engine, rank, range(2, 4))
    engine.wait_for_checkpoint()


def _straight(rank: int, world: int):
    engine = _engine(1)
    return _train(engine, rank, range(3)), _params(engine)


def _resume_latest(rank: int, world: int, root: str):
    engine = _engine(1)
    path, _ = engine.load_checkpoint(root)
    return path, _train(engine, rank, range(1, 3)), _params(engine)


@pytest.mark.parametrize("where", ["torch_save_synced", "fsync_dir"])
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_which_resumes_bitwise(
        tmp_path: Path, where: str) -> None:
    """Killed in rank 1's writer thread mid-file, or in rank 0's commit just before the rename."""
    with pytest.raises(RankFailed):
        run_ranks(_async_save_then_crash, 2, args=(str(tmp_path), where), timeout=90)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    straight = run_ranks(_straight, 2)
    for (path, tail, params), (record, params2) in zip(run_ranks(_resume_latest, 2, args=(str(tmp_path),)), straight):
        assert path.endswith("good") and tail == record[len(record) - len(tail):]
        assert all(torch.equal(a, b) for a, b in zip(params, params2))


_EXIT_SCRIPT = """
import sys, torch, zerodp
from tests.models import batch, make_model
engine, *_ = zerodp.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "checkpoint": {"async_save": True}})
loss = engine(*batch(0, 0, 0)); engine.backward(loss); engine.step()
engine.save_checkpoint(sys.argv[1], tag="at_exit")
"""


def test_an_async_save_in_flight_is_published_at_exit(tmp_path: Path) -> None:
    """A script that ends right after an async save (no wait, no further step) still publishes it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "latest").read_text() == "at_exit" and (tmp_path / "at_exit" / "meta.json").exists()


def test_async_save_is_a_checked_config_key() -> None:
    from zerodp.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 1}
    assert load_config({**base, "checkpoint": {"async_save": True}}, world_size=1).checkpoint.async_save is True
    assert load_config(base, world_size=1).checkpoint.async_save is False
    with pytest.raises(ConfigError, match="async_save"):
        load_config({**base, "checkpoint": {"async_save": "yes"}}, world_size=1)
