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
