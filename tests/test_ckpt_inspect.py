"""Bad checkpoints handed to the CLI and to load (issue 38): meta.json's own checksum, `zerodp ckpt inspect
[--deep]` verifying what it lists (zerodp's and DeepSpeed's checkpoints), garbage in `latest`, truncated
DeepSpeed files, a node-local `nodes` entry naming an unlisted file, and `--hf-config` garbage. Each is one
line naming the file, exit 1 for bad data and 2 for a bad argument, no traceback."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import RankFailed, run_ranks
from tests.models import train_steps

DS_FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed" / "stage2_fp32"


def _engine():
    import zerodp
    from tests.models import make_model

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerodp.initialize(model=make_model(), config=config)
    return engine


def _save(rank: int, world: int, root: str) -> None:
    engine = _engine()
    train_steps(engine, rank, range(1), gas=1)
    engine.save_checkpoint(root, tag="t")


def _load(rank: int, world: int, root: str) -> None:
    _engine().load_checkpoint(root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank zerodp checkpoint (tag t, `latest` naming it), read only: tests damage copies."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(_save, 2, args=(str(root),), timeout=120)
    return root


@pytest.fixture
def ckpt(tmp_path: Path, saved: Path) -> Path:
    """A copy of `saved` to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m zerodp.cli ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "zerodp.cli", *args], capture_output=True, text=True, timeout=timeout)


def _assert_named(result: subprocess.CompletedProcess, code: int, *named: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and all(n in result.stderr for n in named), result.stderr


# --- meta.json's checksum --------------------------------------------------------------------------


def test_meta_json_and_its_checksum_are_saved(saved: Path) -> None:
    import hashlib

    sidecar = (saved / "t" / "meta.json.sha256").read_text()
    assert sidecar == f"{hashlib.sha256((saved / 't' / 'meta.json').read_bytes()).hexdigest()}  meta.json\n"
    assert json.loads((saved / "t" / "meta.json").read_text())["checksum_file"] == "meta.json.sha256"


def test_twenty_single_character_flips_of_meta_json_are_all_named_as_its_damage(ckpt: Path) -> None:
    """Before meta.json had a checksum, 4 of 20 such flips read as "does not match this model" and 6 loaded."""
    from zerodp.checkpoint.format import CheckpointError, read_meta

    path = ckpt / "t" / "meta.json"
    original = path.read_bytes()
    rng = random.Random(38)
    for position in rng.sample(range(len(original)), 20):
        flipped = bytearray(original)
        choices = b"0123456789abcdef" if chr(original[position]).isalnum() else b' ",:'
        flipped[position] = rng.choice([c for c in choices if c != original[position]])
        path.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=rf"{path} is damaged: its sha256 .* differs"):
            read_meta(ckpt / "t")
    path.write_bytes(original)
    read_meta(ckpt / "t")


def test_a_flipped_shape_digit_fails_the_load_naming_meta_json_not_the_model(ckpt: Path) -> None:
    path = ckpt / "t" / "meta.json"
    text = path.read_text()
    at = text.index('"shape": [') + len('"shape": [') + 2  # inside the first shape's first size
    while not text[at].isdigit():
        at += 1
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    with pytest.raises(RankFailed, match=r"meta.json is damaged: its sha256") as err:
        run_ranks(_load, 2, args=(str(ckpt),), timeout=120)
    assert "does not match this model" not in str(err.value)
    _assert_named(_cli("ckpt", "inspect", str(ckpt)), 1, f"{path} is damaged")


def test_a_checkpoint_without_the_checksum_still_loads_and_one_that_names_it_needs_it(ckpt: Path) -> None:
    from zerodp.checkpoint.format import CheckpointError, read_meta

    (ckpt / "t" / "meta.json.sha256").unlink()
    with pytest.raises(CheckpointError, match=r"meta.json is damaged: meta.json.sha256, which it names .* is missing"):
        read_meta(ckpt / "t")
    meta = json.loads((ckpt / "t" / "meta.json").read_text())
    del meta["checksum_file"]  # as saved before zerodp wrote the checksum
    (ckpt / "t" / "meta.json").write_text(json.dumps(meta))
    assert read_meta(ckpt / "t")["world_size"] == 2
    run_ranks(_load, 2, args=(str(ckpt),), timeout=120)
    result = _cli("ckpt", "inspect", str(ckpt))
    assert result.returncode == 0 and "no meta.json.sha256 (saved before zerodp wrote one)" in result.stdout


# --- zerodp ckpt inspect [--deep] ------------------------------------------------------------------


def test_inspect_of_a_clean_checkpoint_lists_every_file_verified(saved: Path) -> None:
    for deep, status in (([], "ok (size)"), (["--deep"], "ok (sha256)")):
        result = _cli("ckpt", "inspect", str(saved), *deep)
        assert result.returncode == 0, result.stderr
        assert "sha256 verified against meta.json.sha256" in result.stdout
        assert result.stdout.count(status) == 5 and "0 of 5 files damaged" in result.stdout  # 2 rank, 2 rng, engine


def test_inspect_names_each_damaged_file_and_exits_1(ckpt: Path) -> None:
    rank0, rank1, engine = ckpt / "t" / "rank_0_of_2.pt", ckpt / "t" / "rank_1_of_2.pt", ckpt / "t" / "engine.pt"
    rank0.write_bytes(os.urandom(rank0.stat().st_size))  # garbage of the recorded size
    rank1.write_bytes(rank1.read_bytes()[:-100])  # truncated
    engine.unlink()
    result = _cli("ckpt", "inspect", str(ckpt))
    _assert_named(result, 1, f"{rank0} is damaged: not a whole torch.save zip archive",
                  f"{rank1} is damaged: {rank1.stat().st_size:,} bytes, meta.json records", f"{engine} is damaged: missing")
    assert "3 of 5 files damaged" in result.stdout


def test_inspect_deep_rehashes_what_the_quick_pass_cannot_see(ckpt: Path) -> None:
    rng1 = ckpt / "t" / "rng_1.pt"
    data = bytearray(rng1.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor's bytes: size and zip directory unchanged
    rng1.write_bytes(bytes(data))
    assert _cli("ckpt", "inspect", str(ckpt)).returncode == 0
    _assert_named(_cli("ckpt", "inspect", str(ckpt), "--deep"), 1, f"{rng1} is damaged: its sha256 differs")


def test_inspect_reads_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    result = _cli("ckpt", "inspect", str(DS_FIXTURE), "--deep")
    assert result.returncode == 0, result.stderr
    assert "DeepSpeed ZeRO checkpoint, saved by 2 ranks at ZeRO stage 2, fp32" in result.stdout
    assert "0 of 3 files damaged" in result.stdout

    copy = Path(shutil.copytree(DS_FIXTURE, tmp_path / "ds"))
    optim = copy / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    model = copy / "global_step3" / "mp_rank_00_model_states.pt"
    optim.write_bytes(optim.read_bytes()[:-200])
    _flip_inside_largest_member(model)
    result = _cli("ckpt", "inspect", str(copy))
    _assert_named(result, 1, f"{optim} is truncated or damaged")
    _assert_named(_cli("ckpt", "inspect", str(copy), "--deep"), 1, f"{optim} is truncated or damaged",
                  f"{model} is damaged: zip member")


def _flip_inside_largest_member(path: Path) -> None:
    """Flip one bit inside the data of the largest member of a zip archive (not its padding or headers)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[member.header_offset + 26 : member.header_offset + 30])
    data[member.header_offset + 30 + name_len + extra_len + member.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


# --- truncated DeepSpeed files ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_truncated_deepspeed_file_is_named_not_a_torch_runtime_error(tmp_path: Path, name: str) -> None:
    from zerodp.checkpoint.deepspeed import DeepSpeedCheckpoint
    from zerodp.checkpoint.format import CheckpointError

    copy = Path(shutil.copytree(DS_FIXTURE, tmp_path / "ds"))
    path = copy / "global_step3" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or damaged"):
        DeepSpeedCheckpoint(copy / "global_step3")
    _assert_named(_cli("ckpt", "convert", str(copy), str(tmp_path / "out")), 1, f"{path} is truncated or damaged")


# --- garbage in `latest` ---------------------------------------------------------------------------


@pytest.mark.parametrize("content,what", [
    (b"\xff\xfe\x00binary", "it is not UTF-8 text"),
    (b"t" * 300, "is not one tag name"),
    (b"t\nu", "is not one tag name"),
    (b"../../etc", "is not a tag name"),
    (b"", "it is empty"),
    (b"global_step999", "names tag 'global_step999', but"),
], ids=["binary", "too-long", "two-lines", "escaping", "empty", "missing-dir"])
def test_garbage_in_latest_is_named(ckpt: Path, tmp_path: Path, content: bytes, what: str) -> None:
    latest = ckpt / "latest"
    latest.write_bytes(content)
    _assert_named(_cli("ckpt", "inspect", str(ckpt)), 1, str(latest), what)
    _assert_named(_cli("ckpt", "convert", str(ckpt), str(tmp_path / "out")), 1, str(latest), what)


def test_garbage_in_latest_fails_the_load_on_every_rank_naming_it(ckpt: Path) -> None:
    (ckpt / "latest").write_bytes(b"\x00\x01garbage")
    with pytest.raises(RankFailed, match=rf"{ckpt / 'latest'} is damaged"):
        run_ranks(_load, 2, args=(str(ckpt),), timeout=120)


def test_a_latest_that_is_a_fifo_does_not_hang(ckpt: Path) -> None:
    (ckpt / "latest").unlink()
    os.mkfifo(ckpt / "latest")
    _assert_named(_cli("ckpt", "inspect", str(ckpt), timeout=60), 1, f"{ckpt / 'latest'} is damaged: not a regular file")


# --- node-local: a `nodes` entry naming a file meta.json does not list ----------------------------


def test_a_nodes_entry_naming_an_unlisted_file_is_named(ckpt: Path, tmp_path: Path) -> None:
    from zerodp.checkpoint.format import write_meta

    meta = json.loads((ckpt / "t" / "meta.json").read_text())
    meta["nodes"] = [{"host": "h0", "ranks": [0, 1], "files": ["engine.pt", "rank_0_of_2.pt", "rank_7_of_8.pt"]}]
    write_meta(ckpt / "t", meta)  # consistent checksum: the structure check is what must catch it
    _assert_named(_cli("ckpt", "gather", str(ckpt), "--out", str(tmp_path / "out")), 1,
                  "meta.json is damaged", "nodes[0] (host h0) names rank_7_of_8.pt, which 'files' does not list")


# --- --hf-config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("content,what", [
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b"\xff\xfe", "is not a readable JSON config"),
    (b'{"model_type": ', "is not a readable JSON config"),
    (None, "not a regular file but a FIFO"),
], ids=["list", "binary", "truncated", "fifo"])
def test_hf_config_garbage_is_refused_before_anything_is_written(saved: Path, tmp_path: Path, content, what) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    if content is None:
        os.mkfifo(hf / "config.json")
    else:
        (hf / "config.json").write_bytes(content)
    out = tmp_path / "out"
    _assert_named(_cli("ckpt", "convert", str(saved), str(out), "--hf-config", str(hf), timeout=60), 2,
                  f"--hf-config {hf}: {hf / 'config.json'}", what)
    assert not out.exists()


def test_max_shard_size_past_any_disk_is_a_usage_error(saved: Path, tmp_path: Path) -> None:
    result = _cli("ckpt", "convert", str(saved), str(tmp_path / "out"), "--max-shard-size", "1e400GB")
    _assert_named(result, 2, "argument --max-shard-size: '1e400GB': expected a size")
    assert not (tmp_path / "out").exists()
