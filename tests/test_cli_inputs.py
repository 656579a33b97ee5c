"""Bad input to the CLI's model and report arguments: one line naming the file or the argument, an exit
code, no traceback, no hang (issue 38's battery, the classes that reach plan/ and report/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerodp.cli import main

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64}


def _config(tmp_path: Path, content: bytes | dict | list) -> str:
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


@pytest.mark.parametrize("content,named", [
    ([1, 2], "a Hugging Face config is a JSON object, not a list"),
    (bytes(range(256)), "not a readable JSON config (UnicodeDecodeError"),
    (b'{"model_type": "llama", "hidden_size": ', "not a readable JSON config (JSONDecodeError"),
    ({**LLAMA, "num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 is not a whole number from 1 to 10,000"),
    ({**LLAMA, "hidden_size": "wide"}, "hidden_size 'wide' is not a whole number"),
    ({**LLAMA, "text_config": {"num_hidden_layers": -1}}, "text_config: num_hidden_layers -1 is not a whole number"),
    ({"model_type": "no_such_model"}, "transformers cannot read it"),
], ids=["list", "binary", "truncated", "1e9-layers", "string-width", "nested", "unknown-type"])
@pytest.mark.parametrize("command", [["estimate", "--model-states-only"],
                                     ["plan", "--gpu", "cpu", "--seq-len", "8", "--global-batch", "2"]])
def test_a_bad_model_config_is_one_line_naming_the_file(tmp_path, capsys, command, content, named) -> None:
    pytest.importorskip("transformers")
    path = _config(tmp_path, content)
    started = time.monotonic()
    code = main([command[0], path, *command[1:]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and path in err and "Traceback" not in err
    assert time.monotonic() - started < 30  # refused before anything is built, not after a long loop


def test_a_gpt_spec_past_the_bounds_is_refused_before_building(capsys) -> None:
    assert main(["estimate", "gpt:n_layer=100000000", "--model-states-only"]) == 2
    assert "n_layer 100000000 is not a whole number from 1 to 10,000" in capsys.readouterr().err


def test_a_fifo_as_the_model_config_is_refused_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "zerodp.cli", "estimate", str(fifo), "--model-states-only"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not a regular file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("content,named", [
    (b"[1, 2]", "a JSON list, not an object"),
    (bytes(range(256)), "UnicodeDecodeError"),
    (json.dumps({"rank": 0, "phase": "forward"}).encode(), "'world_size' should be a int"),
    (json.dumps({"rank": "0"}).encode(), "'rank' should be a int, found '0'"),
], ids=["list", "binary", "missing-field", "wrong-type"])
def test_doctor_on_a_damaged_report_names_it_and_exits_1(tmp_path, capsys, content, named) -> None:
    report = tmp_path / "rank0.json"
    report.write_bytes(content)
    assert main(["doctor", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert named in err and str(report) in err and "Traceback" not in err


def test_compare_out_naming_a_file_is_refused_before_any_launch(tmp_path, capsys) -> None:
    existing = tmp_path / "report.md"
    existing.write_text("keep me")
    assert main(["compare", "demo", "--frameworks", "ddp", "--out", str(existing)]) == 2
    assert f"--out {existing}: a file is there" in capsys.readouterr().err
    assert existing.read_text() == "keep me" and not (tmp_path / "logs").exists()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m zerodp.cli ARGS`, as a user runs it (a timeout: a read that blocks fails the test)."""
    return subprocess.run([sys.executable, "-m", "zerodp.cli", *args], capture_output=True, text=True, timeout=timeout)


def _deepspeed_config(tmp_path: Path, kind: str) -> str:
    """A DeepSpeed config path of one bad kind."""
    if kind == "/dev/zero":
        return "/dev/zero"
    path = tmp_path / "ds.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:  # sparse: 17 MiB of NUL bytes without writing them
            f.truncate(17 << 20)
    else:
        path.write_bytes({"binary": bytes(range(256)), "list": b"[1, 2]", "number": b"3"}[kind])
    return str(path)


_CONFIG_KINDS = {
    "/dev/zero": "not a regular file but a character device",
    "fifo": "not a regular file but a FIFO",
    "directory": "not a regular file but a directory",
    "huge": "over 16,777,216 bytes",
    "binary": "is not UTF-8 text (byte 0x80 at offset 128)",
    "list": "the top level must be a JSON object, got [1, 2]",
    "number": "the top level must be a JSON object, got 3",
}


@pytest.mark.parametrize("kind", list(_CONFIG_KINDS))
def test_config_check_of_a_bad_config_file_names_it_without_blocking(tmp_path, kind) -> None:
    path = _deepspeed_config(tmp_path, kind)
    started = time.monotonic()
    result = _cli("config", "check", path, "--world-size", "2")
    assert result.returncode == 1, result.stderr
    assert f"DeepSpeed config '{path}'" in result.stderr and _CONFIG_KINDS[kind] in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - started < 30


@pytest.mark.parametrize("kind", ["fifo", "binary", "list"])
def test_demo_config_of_a_bad_file_is_a_usage_error_before_any_launch(tmp_path, kind) -> None:
    path = _deepspeed_config(tmp_path, kind)
    result = _cli("demo", "--config", path, "--stage", "2")
    assert result.returncode == 2, result.stderr
    assert f"zerodp demo: 1 problem in DeepSpeed config '{path}'" in result.stderr
    assert _CONFIG_KINDS[kind] in result.stderr and "Traceback" not in result.stderr


def test_load_config_from_a_fifo_raises_config_error_without_blocking(tmp_path) -> None:
    from zerodp.config import ConfigError, load_config

    path = _deepspeed_config(tmp_path, "fifo")
    with pytest.raises(ConfigError, match="not a regular file but a FIFO"):
        load_config(path, world_size=1)


def test_demo_config_with_a_section_of_the_wrong_type_is_named(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": [1]}))
    assert main(["demo", "--config", str(path), "--stage", "2"]) == 2
    err = capsys.readouterr().err
    assert f"DeepSpeed config '{path}'" in err and "zero_optimization: got [1]; expected a JSON object" in err
    assert "Traceback" not in err
