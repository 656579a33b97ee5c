"""Checkpoints: exact resume, load at any world size and stage, crash safety, corruption, safety."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.harness import RankFailed, full_state, run_ranks
from tests.models import batch, make_model

GAS = 2


def _engine(stage: int, precision: dict | None = None, model: torch.nn.Module | None = None):
    import zerodp

    model = model if model is not None else make_model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
              # stage 3: parameters up to 100 elements (norms, biases) stay whole, the rest is sharded
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 100} if stage == 3 else {})},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
              **(precision or {})}
    engine, *_ = zerodp.initialize(model=model, config=config)
    return engine


def _train(engine, rank: int, steps: range) -> list[float]:
    record = []
    for step in steps:
        for micro in range(GAS):
            loss = engine(*batch(rank, step, micro))
            engine.backward(loss)
            engine.step()
            record.append(loss.item())
        record.append(torch.rand(1).item())  # RNG state must continue identically after a resume
    return record


def _params(engine) -> list[torch.Tensor]:
    import zerodp

    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: full values
        return [p.detach().float().clone() for p in engine.module.parameters()]


def _continuous(rank: int, world: int, stage: int, precision: dict):
    engine = _engine(stage, precision)
    return _train(engine, rank, range(6)), _params(engine), engine.loss_scale, engine.get_lr()


def _first_half(rank: int, world: int, stage: int, precision: dict, path: str):
    engine = _engine(stage, precision)
    record = _train(engine, rank, range(3))
    engine.save_checkpoint(path, client_state={"epoch": 7, "note": "plain data"})
    return record


def _second_half(rank: int, world: int, stage: int, precision: dict, path: str):
    engine = _engine(stage, precision)
    loaded, client_state = engine.load_checkpoint(path)
    record = _train(engine, rank, range(3, 6))
    return record, _params(engine), engine.loss_scale, engine.get_lr(), client_state, engine.global_steps


PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}}


@pytest.mark.parametrize("precision,world", [("bf16", 2), ("fp16", 2), ("fp32", 2), ("fp32", 4)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact(tmp_path: Path, stage: int, precision: str, world: int) -> None:
    """6 steps straight == 3 steps, save, new processes, load, 3 steps: losses, parameters, RNG,
    loss scale (fp16's window of 2 makes it grow during the run) and lr, bit for bit. At 4 ranks
    this needs stage 0's bucket order to be restored too (gloo's sums depend on it)."""
    extra = PRECISIONS[precision]
    straight = run_ranks(_continuous, world, args=(stage, extra))
    first = run_ranks(_first_half, world, args=(stage, extra, str(tmp_path)))
    second = run_ranks(_second_half, world, args=(stage, extra, str(tmp_path)))
    for (record, params, scale, lr), head, (tail, params2, scale2, lr2, client, steps) in zip(straight, first, second):
        assert head + tail == record
        assert all(torch.equal(a, b) for a, b in zip(params, params2))
        assert (scale, lr) == (scale2, lr2)
        assert client == {"epoch": 7, "note": "plain data"} and steps == 6
    assert (tmp_path / "latest").read_text() == "global_step3"


# --- any world size, any stage ----------------------------------------------------------------------


def _save_all_at(rank: int, world: int, root: str):
    states = {}
    for stage in (0, 1, 2, 3):
        engine = _engine(stage)
        _train(engine, rank, range(2))
        engine.save_checkpoint(os.path.join(root, f"w{world}s{stage}"), tag="ckpt")
        states[f"w{world}s{stage}"] = full_state(engine)
    return states


def _load_all_at(rank: int, world: int, root: str, sources: list[str]):
    states = {}
    for stage in (0, 1, 2, 3):
        for source in sources:
            engine = _engine(stage)
            engine.load_checkpoint(os.path.join(root, source), tag="ckpt")
            states[(f"w{world}s{stage}", source)] = (full_state(engine), engine.global_steps)
    return states


def test_every_checkpoint_loads_at_every_world_size_and_stage(tmp_path: Path) -> None:
    # one set of processes per world size (each builds every stage's engines): the 144 pairs in 6 launches
    saved = {}
    for world in (1, 2, 4):
        saved.update(run_ranks(_save_all_at, world, args=(str(tmp_path),))[0])
    for world in (1, 2, 4):
        loaded = run_ranks(_load_all_at, world, args=(str(tmp_path), sorted(saved)))[0]
        assert len(loaded) == 4 * len(saved) == 48
        for (at, source), (state, steps) in loaded.items():
            assert steps == 2
            assert state.keys() == saved[source].keys(), (source, at)
            for name, tensors in saved[source].items():
                for key, t in tensors.items():
                    assert torch.equal(state[name][key], t), (source, at, name, key)


# --- crash safety, corruption, safe loading ---------------------------------------------------------


def _save_then_crash(rank: int, world: int, root: str, where: str):
    from zerodp.checkpoint import save as save_module

    engine = _engine(1)
    _train(engine, rank, range(1))
    engine.save_checkpoint(root, tag="good")
    _train(engine, rank, range(1, 2))
    original = getattr(save_module, where)

    def crash(*args, **kwargs):
        if rank == (1 if where == "torch_save_synced" else 0):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9, mid-save
        return original(*args, **kwargs)

    setattr(save_module, where, crash)
    engine.save_checkpoint(root, tag="bad")


def _load_latest(rank: int, world: int, root: str):
    engine = _engine(1)
    path, _ = engine.load_checkpoint(root)
    return path, engine.global_steps


@pytest.mark.parametrize("where", ["torch_save_synced", "fsync_dir"])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, where: str) -> None:
    """Killed while writing its shard (rank 1) or just before the rename that publishes (rank 0)."""
    with pytest.raises(RankFailed):
        run_ranks(_save_then_crash, 2, args=(str(tmp_path), where), timeout=90)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    for path, steps in run_ranks(_load_latest, 2, args=(str(tmp_path),)):
        assert path.endswith("good") and steps == 1


def _save_one(rank: int, world: int, root: str, client_state: dict | None = None):
    engine = _engine(2)
    _train(engine, rank, range(1))
    engine.save_checkpoint(root, tag="t", client_state=client_state)


def _load_one(rank: int, world: int, root: str, tag: str | None = "t"):
    _engine(2).load_checkpoint(root, tag=tag)


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> Path:
    """One 2-rank stage-2 checkpoint (tag "t") that the damage tests copy and then damage."""
    root = tmp_path_factory.mktemp("saved")
    run_ranks(_save_one, 2, args=(str(root),))
    return root


def _corrupt(root: Path, how: str) -> None:
    shard = root / "t" / "rank_1_of_2.pt"
    if how == "bit flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "missing":
        shard.unlink()
    else:  # a newer format
        _rewrite_meta(root, lambda meta: meta.__setitem__("format_version", 99))


@pytest.mark.parametrize("how,message", [
    ("bit flip", r"rank_1_of_2.pt is corrupt"), ("truncated", r"rank_1_of_2.pt is corrupt"),
    ("missing", r"rank_1_of_2.pt is missing"), ("newer", r"format version 99 is newer"),
])
def test_damaged_checkpoints_are_named_on_every_rank(tmp_path: Path, saved_once: Path, how: str, message: str) -> None:
    shutil.copytree(saved_once, tmp_path, dirs_exist_ok=True)
    _corrupt(tmp_path, how)
    with pytest.raises(RankFailed, match=message):
        run_ranks(_load_one, 2, args=(str(tmp_path),), timeout=100)


def _outcome(action) -> tuple[str, str]:
    """("ok", "") or (error type, message): each rank reports, so a test sees that every rank raised."""
    try:
        action()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    return "ok", ""


def _load_outcome(rank: int, world: int, root: str):
    return _outcome(lambda: _load_one(rank, world, root))


def _rewrite_meta(root: Path, edit) -> None:
    """meta.json edited on purpose, its checksum (meta.json.sha256) rewritten to match."""
    from zerodp.checkpoint.format import write_meta

    meta = json.loads((root / "t" / "meta.json").read_text())
    edit(meta)
    write_meta(root / "t", meta)


def _write_meta_bytes(root: Path, data: bytes) -> None:
    """meta.json replaced by `data`, with a matching meta.json.sha256: the checks after the checksum's."""
    (root / "t" / "meta.json").write_bytes(data)
    (root / "t" / "meta.json.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  meta.json\n")


def _legacy_pickle_rng(root: Path) -> None:
    """rng_1.pt as a pre-zip torch.save file, with meta.json's checksum updated to match."""
    from zerodp.checkpoint.format import sha256

    path = root / "t" / "rng_1.pt"
    torch.save({"torch": torch.get_rng_state()}, path, _use_new_zipfile_serialization=False)
    _rewrite_meta(root, lambda m: m["files"]["rng_1.pt"].update(sha256=sha256(path), bytes=path.stat().st_size))


def _escaping_name(root: Path) -> None:
    outside = root / "outside.pt"
    (root / "t" / "rank_1_of_2.pt").rename(outside)
    _rewrite_meta(root, lambda m: m["files"].__setitem__("rank_x/../../outside.pt", m["files"].pop("rank_1_of_2.pt")))


@pytest.mark.parametrize("damage,message", [
    (lambda root: (root / "t" / "rng_1.pt").write_bytes(b"damaged"), r"rng_1.pt is corrupt"),
    (lambda root: _rewrite_meta(root, lambda m: m["files"]["rank_0_of_2.pt"].pop("sha256")),
     r"meta.json is damaged: files\['rank_0_of_2.pt'\]: 'sha256' is None, expected 64 hex digits"),
    (lambda root: _write_meta_bytes(root, b"\xff\xfe garbage"), r"meta.json is damaged: not valid UTF-8 JSON"),
    (lambda root: _write_meta_bytes(root, b'{"format_version": 1, "files": '), r"meta.json is damaged: not valid"),
    (_escaping_name, r"rank_x/../../outside.pt'\]: not a file name a zerodp save writes"),
    (_legacy_pickle_rng, r"rng_1.pt is not a zerodp checkpoint file"),
], ids=["rng file", "sha256 entry", "meta not utf-8", "meta not json", "escaping name", "legacy pickle"])
def test_a_problem_one_rank_finds_is_raised_on_every_rank(tmp_path: Path, saved_once: Path, damage, message: str) -> None:
    shutil.copytree(saved_once, tmp_path, dirs_exist_ok=True)
    damage(tmp_path)
    # Less than the harness's 120 s collective timeout: a rank left waiting fails the test here.
    outcomes = run_ranks(_load_outcome, 2, args=(str(tmp_path),), timeout=100)
    for rank, (kind, text) in enumerate(outcomes):
        assert kind == "CheckpointError", (rank, kind, text)
        assert re.search(message, text), (rank, text)


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 16 KiB tmpfs: torch.save of a rank file fills it, and torch raises its own RuntimeError
    ("[enforce fail at inline_container.cc] unexpected pos"), which the save reports as DiskFull."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _save_with_a_full_disk(rank: int, world: int, root: str, full: str):
    from zerodp.checkpoint import save as save_module

    engine = _engine(2, model=make_model(dim=64))  # tensors of 32 KiB: the write that fills the disk is partial
    _train(engine, rank, range(1))
    if rank == 1:  # rank 1's shard goes to the full disk; rank 0's is written where it belongs
        write = save_module.torch_save_synced
        save_module.torch_save_synced = lambda obj, path: write(obj, Path(full) / path.name)
    return _outcome(lambda: engine.save_checkpoint(root, tag="t"))


def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank_and_leaves_no_partial_tag(
        tmp_path: Path, full_disk: Path) -> None:
    root = tmp_path / "ckpt"
    (kind0, text0), (kind1, text1) = run_ranks(_save_with_a_full_disk, 2, args=(str(root), str(full_disk)), timeout=100)
    # torch's own error ("enforce fail ... unexpected pos") is named for what it is, with the numbers
    assert kind1 == "DiskFull" and re.match(rf"no space left on {full_disk} \(needed [\d,]+ bytes, free [\d,]+ bytes\)",
                                            text1), text1
    assert kind0 == "PeerFailed" and text0.startswith("rank 1 failed with DiskFull: no space left on"), text0
    assert list(root.iterdir()) == []  # no t.tmp, no t, no latest


@pytest.mark.parametrize("to", ["safetensors", "fp32"])
def test_a_conversion_from_a_corrupt_file_fails_by_name_and_leaves_no_partial_shard(tmp_path: Path, to: str,
                                                                                    capsys) -> None:
    from zerodp.cli import main

    ckpt = tmp_path / "ckpt"  # OUT beside it: an output inside the checkpoint read is refused
    run_ranks(_save_one, 2, args=(str(ckpt),))
    _corrupt(ckpt, "bit flip")  # rank 1's file: rank 0's pieces are written first
    out = tmp_path / "out"
    assert main(["ckpt", "convert", str(ckpt), str(out), "--to", to, "--max-shard-size", "1KB"]) != 0
    assert "rank_1_of_2.pt is corrupt" in capsys.readouterr().err
    assert list(out.iterdir()) == []


class NotPlainData:
    pass


def test_pickled_objects_are_refused_on_load(tmp_path: Path) -> None:
    run_ranks(_save_one, 1, args=(str(tmp_path), {"obj": NotPlainData()}))
    with pytest.raises(RankFailed, match=r"engine.pt holds a pickled Python object"):
        run_ranks(_load_one, 1, args=(str(tmp_path),))


def _escape(rank: int, world: int, root: str, action: str):
    engine = _engine(0)
    if action == "save":
        engine.save_checkpoint(root, tag="../outside")
    else:
        engine.load_checkpoint(root, tag="../outside")


@pytest.mark.parametrize("action", ["save", "load"])
def test_tags_that_escape_the_directory_are_refused(tmp_path: Path, action: str) -> None:
    with pytest.raises(RankFailed, match="not a plain directory name"):
        run_ranks(_escape, 1, args=(str(tmp_path), action))


def _nothing_to_load(rank: int, world: int, root: str):
    return _engine(0).load_checkpoint(root)


def test_loading_from_an_empty_directory_returns_none(tmp_path: Path) -> None:
    assert run_ranks(_nothing_to_load, 1, args=(str(tmp_path),)) == [(None, None)]


def _save_on_rank0_only(rank: int, world: int, root: str):
    import time

    engine = _engine(0)
    if rank == 0:
        engine.save_checkpoint(root)
    else:
        time.sleep(600)  # never calls it; the harness stops this rank once rank 0 has failed


def test_save_called_on_one_rank_only_names_the_missing_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailed, match=r"save_checkpoint must be called on every rank.*\b1\b"):
        run_ranks(_save_on_rank0_only, 2, args=(str(tmp_path),), env={"ZERODP_TIMEOUT": "5"}, timeout=100)


# --- consolidated export -------------------------------------------------------------------------------


def _save_for_export(rank: int, world: int, root: str):
    engine = _engine(2)
    _train(engine, rank, range(2))
    engine.save_checkpoint(root)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_export_to_safetensors_and_state_dict_equals_the_trained_weights(tmp_path: Path, capsys) -> None:
    from zerodp.checkpoint import load_state_dict_from_checkpoint, read_safetensors
    from zerodp.cli import main

    trained = run_ranks(_save_for_export, 2, args=(str(tmp_path / "ckpt"),))[0]
    state = load_state_dict_from_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(state[n], t) for n, t in trained.items())  # fp32: params are the masters
    assert main(["ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "2KB"]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    exported = {k: v for shard in shards for k, v in read_safetensors(tmp_path / "out" / shard).items()}
    assert set(state) - set(exported) == {"head.weight"}  # tied to embed.weight: written once
    assert all(torch.equal(exported[n], state[n]) for n in exported)
    assert not list((tmp_path / "out").glob("*.tmp"))
    model = make_model(seed=1)
    model.load_state_dict(state)  # strict: every name, tied ones included
    assert torch.equal(model.head.weight, trained["embed.weight"])
    assert main(["ckpt", "inspect", str(tmp_path / "ckpt")]) == 0
    assert "saved by 2 ranks at ZeRO stage 2" in capsys.readouterr().out


@pytest.mark.parametrize("max_shard", ["2KB", "5GB"])
def test_export_to_pytorch_model_bin_keeps_tied_names_in_one_shard(tmp_path: Path, max_shard: str) -> None:
    from zerodp.checkpoint import load_state_dict_from_checkpoint
    from zerodp.cli import main

    run_ranks(_save_for_export, 2, args=(str(tmp_path / "ckpt"),))
    state = load_state_dict_from_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)
    out = tmp_path / "out"
    assert main(["ckpt", "convert", str(tmp_path / "ckpt"), str(out), "--to", "fp32", "--dtype", "bf16",
                 "--max-shard-size", max_shard]) == 0
    if max_shard == "5GB":
        files = ["pytorch_model.bin"]
    else:
        weight_map = json.loads((out / "pytorch_model.bin.index.json").read_text())["weight_map"]
        assert weight_map["head.weight"] == weight_map["embed.weight"]
        files = sorted(set(weight_map.values()))
        assert len(files) > 1
    exported = {k: v for f in files for k, v in torch.load(out / f, weights_only=True).items()}
    assert exported.keys() == state.keys()
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], state[n]) for n in state)
    assert exported["head.weight"].data_ptr() == exported["embed.weight"].data_ptr()


# --- frozen parameters and buffers ---------------------------------------------------------------------


def _frozen_model(seed: int) -> torch.nn.Module:
    """BlockLM with one block frozen and a buffer: what a fine-tune looks like to a checkpoint."""
    from tests.models import make_block_lm

    model = make_block_lm(seed)
    model.blocks[1].requires_grad_(False)
    model.register_buffer("table", torch.randn(5))
    return model


def _everything(engine) -> dict[str, torch.Tensor]:
    import zerodp

    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: t.detach().clone() for n, t in [*engine.module.named_parameters(), *engine.module.named_buffers()]}


def _save_frozen(rank: int, world: int, stage: int, root: str):
    engine = _engine(stage, model=_frozen_model(seed=0))
    _train(engine, rank, range(2))
    engine.module.table.mul_(3)  # a buffer that changed during training
    engine.save_checkpoint(root, tag="t")
    return _everything(engine)


def _load_frozen(rank: int, world: int, stage: int, root: str):
    engine = _engine(stage, model=_frozen_model(seed=1))
    engine.load_checkpoint(root, tag="t")
    return _everything(engine)


@pytest.mark.parametrize("saved_at,loaded_at", [((2, 3), (1, 0)), ((2, 3), (2, 3)), ((1, 2), (2, 3))])
def test_frozen_parameters_and_buffers_round_trip(tmp_path: Path, saved_at: tuple, loaded_at: tuple) -> None:
    """Frozen parameters and buffers are not in the rank files (no optimizer state): stage 3 gathers
    them unit by unit into engine.pt and scatters them back into the shards on load."""
    from zerodp.checkpoint import load_state_dict_from_checkpoint

    saved = run_ranks(_save_frozen, saved_at[0], args=(saved_at[1], str(tmp_path)))[0]
    fresh = _frozen_model(seed=1)
    assert not torch.equal(fresh.blocks[1].fc1.weight, saved["blocks.1.fc1.weight"])  # the load has work to do
    loaded = run_ranks(_load_frozen, loaded_at[0], args=(loaded_at[1], str(tmp_path)))
    for state in loaded:
        assert state.keys() == saved.keys()
        assert all(torch.equal(state[n], t) for n, t in saved.items()), [n for n, t in saved.items()
                                                                        if not torch.equal(state[n], t)]
    exported = load_state_dict_from_checkpoint(tmp_path)
    assert all(torch.equal(exported[n], t) for n, t in saved.items())


# --- the data loader's position ---------------------------------------------------------------------


def _loader_run(rank: int, world: int, root: str, phase: str):
    import zerodp

    model = make_model()
    data = torch.utils.data.TensorDataset(torch.arange(100))
    engine, _, loader, _ = zerodp.initialize(model=model, training_data=data, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    if phase == "second":
        engine.load_checkpoint(root)
    seen = []
    for (indices,) in loader:
        seen.append(indices.tolist())
        if phase == "first" and len(seen) == 5:
            engine.save_checkpoint(root)
            break
    return seen


def test_the_training_loader_resumes_where_it_stopped(tmp_path: Path) -> None:
    straight = run_ranks(_loader_run, 2, args=(str(tmp_path / "a"), "straight"))
    first = run_ranks(_loader_run, 2, args=(str(tmp_path / "b"), "first"))
    second = run_ranks(_loader_run, 2, args=(str(tmp_path / "b"), "second"))
    for whole, head, tail in zip(straight, first, second):
        assert head + tail == whole and len(tail) == len(whole) - 5


def _different_tags(rank: int, world: int, root: str, policy: str):
    import zerodp

    def build():
        return zerodp.initialize(model=make_model(), config={
            "train_micro_batch_size_per_gpu": 4, "checkpoint": {"tag_validation": policy},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]

    engine = build()
    _train(engine, rank, range(2))
    engine.save_checkpoint(root, tag=f"tag_of_rank_{rank}")
    again = build()
    path, _ = again.load_checkpoint(root)
    same = all(torch.equal(a, b) for a, b in zip(_params(again), _params(engine), strict=True))
    return sorted(p.name for p in Path(root).iterdir()), path, same


def test_tags_that_differ_between_ranks_fail_under_tag_validation_fail(tmp_path: Path) -> None:
    with pytest.raises(RankFailed, match=r"checkpoint tags differ between ranks: rank 0 'tag_of_rank_0', rank 1 "
                                         r"'tag_of_rank_1' \(checkpoint.tag_validation=Fail\); pass the same tag"):
        run_ranks(_different_tags, 2, args=(str(tmp_path), "Fail"))


@pytest.mark.parametrize("policy", ["Warn", "Ignore"])
def test_tags_that_differ_between_ranks_save_one_checkpoint_under_rank_0s_tag(tmp_path: Path, policy: str) -> None:
    """DeepSpeed saves each rank's pieces under its own tag (two incomplete checkpoints); zerodp writes
    one complete one, under rank 0's tag, which loads."""
    for entries, path, same in run_ranks(_different_tags, 2, args=(str(tmp_path), policy)):
        assert entries == ["latest", "tag_of_rank_0", "zero_to_fp32.py"] and path.endswith("tag_of_rank_0") and same


def _missing_dir(rank: int, world: int, which: str, value):
    import zerodp

    engine, *_ = zerodp.initialize(model=make_model(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        engine.save_checkpoint(value) if which == "save" else engine.load_checkpoint(value)
    except ValueError as err:  # DeepSpeed's type: its own tests expect ValueError
        return str(err)


@pytest.mark.parametrize("which,value", [("save", None), ("save", ""), ("load", None), ("load", " ")])
def test_a_missing_checkpoint_dir_is_a_value_error_before_anything_is_written(tmp_path: Path, which: str,
                                                                              value: object) -> None:
    """An empty save_dir wrote global_step0 into the working directory; None gave os.path's TypeError."""
    os.chdir(tmp_path)
    argument = "save_dir" if which == "save" else "load_dir"
    for message in run_ranks(_missing_dir, 2, args=(which, value)):
        assert message == f"{argument}={value!r}: a checkpoint directory is needed, e.g. {argument}='checkpoints'"
    assert list(tmp_path.iterdir()) == []


# --- found in review ------------------------------------------------------------------------------------


def _sgd_momentum(rank: int, world: int, root: str, phase: str):
    import zerodp

    model = make_model()
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
                                   config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}})
    if phase == "second":
        engine.load_checkpoint(root)
    _train(engine, rank, range(2) if phase != "second" else range(2, 4))
    if phase == "first":
        engine.save_checkpoint(root)
    if phase == "straight":
        _train(engine, rank, range(2, 4))
    return _params(engine)


def test_sgd_momentum_survives_a_resume(tmp_path: Path) -> None:
    """SGD has only per-element state (momentum_buffer), no step counter."""
    straight = run_ranks(_sgd_momentum, 2, args=(str(tmp_path), "straight"))
    run_ranks(_sgd_momentum, 2, args=(str(tmp_path), "first"))
    resumed = run_ranks(_sgd_momentum, 2, args=(str(tmp_path), "second"))
    assert all(torch.equal(a, b) for a, b in zip(straight[0], resumed[0]))


def test_resuming_after_an_epoch_ended_starts_the_next_epoch_whole() -> None:
    from zerodp.data import ResumableDistributedSampler

    saved = ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    assert len(list(saved)) == 8  # the whole epoch 0, then a checkpoint
    resumed = ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    resumed.load_state_dict(saved.state_dict())
    assert list(resumed) == []  # epoch 0 is over
    resumed.set_epoch(1)
    fresh = ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    fresh.set_epoch(1)
    assert list(resumed) == list(fresh) and len(list(fresh)) == 8


def _shape_mismatch(rank: int, world: int, root: str):
    import zerodp

    engine, *_ = zerodp.initialize(model=make_model(dim=16), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(root)
    transposed = make_model(dim=16)
    transposed.fc1.weight = torch.nn.Parameter(transposed.fc1.weight.detach().t().contiguous().view(16, 64))
    other, *_ = zerodp.initialize(model=transposed, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    try:
        other.load_checkpoint(root, load_optimizer_states=False)
    except ValueError as err:
        shape_error = str(err)
    optimizer_error = None
    try:
        _engine(0).load_checkpoint(root)
    except ValueError as err:
        optimizer_error = str(err)
    return shape_error, optimizer_error


def test_same_numel_other_shape_and_other_optimizer_are_refused(tmp_path: Path) -> None:
    (shape_error, optimizer_error), = run_ranks(_shape_mismatch, 1, args=(str(tmp_path),))
    assert "fc1.weight (saved [64, 16], model [16, 64])" in shape_error
    assert "holds SGD state but the engine's optimizer is AdamW" in optimizer_error


def _resume_with_a_group_rank_0_does_not_own(rank: int, world: int, tmp: str, stage: int) -> dict:
    import zerodp
    from tests.models import two_groups

    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    def make():
        model = make_model()
        engine, *_ = zerodp.initialize(model=model, config=cfg,
                                       optimizer=torch.optim.AdamW(two_groups(model), lr=1e-2, foreach=True))
        return engine

    def train(engine, steps):
        for step in steps:
            engine.backward(engine(*batch(rank, step, 0)))
            engine.step()
        with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    straight = train(make(), range(2))
    first = make()
    train(first, range(1))
    owned = [sum(p.numel() for p in g["params"]) for g in first.optimizer.param_groups]
    first.save_checkpoint(tmp)
    resumed = make()
    resumed.load_checkpoint(tmp)
    after = train(resumed, range(1, 2))
    return {"owned": owned, "equal": all(torch.equal(after[n], straight[n]) for n in straight)}


def test_resume_when_rank_0_owns_no_element_of_a_param_group(tmp_path: Path) -> None:
    # before: the group's Adam `step` came from rank 0's optimizer, which held none for it, and the
    # first step after resuming raised KeyError: 'step' on the rank that does own its elements
    results = run_ranks(_resume_with_a_group_rank_0_does_not_own, 2, args=(str(tmp_path / "ckpt"), 3))
    assert results[0]["owned"][1] == 0 < results[1]["owned"][1]  # the case: rank 0 owns nothing of group 2
    assert all(r["equal"] for r in results)


def test_hosts_that_share_a_checkpoint_directory_with_only_some_others_are_refused_by_group() -> None:
    from zerodp.checkpoint.save import _storage_problem
    from zerodp.zero.topology import NodeLayout, ranks_by_node

    nodes = ranks_by_node(["a#0", "a#0", "b#1", "b#1", "c#2", "c#2", "d#3", "d#3"])
    assert nodes == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ranks_by_node(["x", "y", "x"]) == [[0, 2], [1]]  # not contiguous: grouped all the same
    layout = NodeLayout(tuple(map(tuple, nodes)), ("a#0", "b#1", "c#2", "d#3"))
    shared = {k: [0, 1, 2, 3] for k in range(4)}
    apart = {k: [k] for k in range(4)}
    pairs = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    assert _storage_problem(Path("ckpt"), layout, shared, node_local=False) is None
    assert _storage_problem(Path("ckpt"), layout, shared, node_local=True) is None
    assert _storage_problem(Path("ckpt"), layout, apart, node_local=True) is None
    assert "host b#1 (ranks 2-3) does not see what host a#0 (ranks 0-1) writes" in _storage_problem(
        Path("ckpt"), layout, apart, node_local=False)
    for node_local in (False, True):
        assert "shared by some hosts but not all" in _storage_problem(Path("ckpt"), layout, pairs, node_local)
        assert "[['a#0', 'b#1'], ['c#2', 'd#3']]" in _storage_problem(Path("ckpt"), layout, pairs, node_local)


@pytest.mark.parametrize("saved_ranks,resumed_ranks", [(2, 1), (1, 2), (4, 2), (2, 3)])
def test_a_resume_at_another_world_size_continues_the_epoch_where_the_ranks_stopped(saved_ranks: int,
                                                                                  resumed_ranks: int) -> None:
    """The saved ranks' positions are the epoch's first num_yielded x ranks samples; at another world size
    the resumed ranks read on from there together (replaying at most resumed_ranks - 1, never skipping)."""
    from zerodp.data import ResumableDistributedSampler

    data = list(range(48))
    saved = [ResumableDistributedSampler(data, num_replicas=saved_ranks, rank=r, seed=3) for r in range(saved_ranks)]
    import itertools

    seen = [i for s in saved for i in itertools.islice(iter(s), 24 // saved_ranks + 1)]  # 24 / R + 1 samples each
    resumed = []
    for r in range(resumed_ranks):
        sampler = ResumableDistributedSampler(data, num_replicas=resumed_ranks, rank=r, seed=3)
        sampler.load_state_dict(saved[0].state_dict())
        resumed += list(sampler)
    assert set(seen) | set(resumed) == set(data)  # nothing skipped
    assert len(set(seen) & set(resumed)) < resumed_ranks  # at most resumed_ranks - 1 samples seen twice


def _accumulation_resume(rank: int, world: int, root: str, accumulation: int) -> list[int]:
    import zerodp

    torch.manual_seed(0)
    config = {"train_batch_size": 4, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    engine, *_ = zerodp.initialize(model=torch.nn.Linear(4, 1), config=config)
    if world == 2:  # the saved run: 3 steps of accumulation 1
        for _ in range(3):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
        engine.save_checkpoint(root)
        return []
    engine.load_checkpoint(root)
    steps = []
    for _ in range(4):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        steps.append(engine.global_steps)
    return steps


def test_a_resume_with_another_accumulation_steps_at_its_own_boundaries(tmp_path: Path) -> None:
    """2 ranks x accumulation 1 saved after 3 steps (micro_steps 3); 1 rank x accumulation 2 resumes: its
    first micro-batch must not be taken for a boundary (3 + 1 is even), its second must."""
    run_ranks(_accumulation_resume, 2, args=(str(tmp_path), 1))
    assert run_ranks(_accumulation_resume, 1, args=(str(tmp_path), 2))[0] == [3, 4, 4, 5]
