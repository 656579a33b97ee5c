"""bench/deepspeed_examples.py's CUDA shim and the bf16_master_weight loss parsing (the bench itself runs in bench/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.deepspeed_examples import _bf16_curve, _bf16_loss, shim_path

_CALLS = "import torch; torch.cuda.set_device(1); torch.cuda.reset_peak_memory_stats(); print('trained')"


def _run(path: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    return subprocess.run([sys.executable, "-c", _CALLS], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim only acts where torch has no CUDA")
def test_the_cuda_shim_makes_the_two_calls_no_ops_and_runs_the_next_sitecustomize(tmp_path: Path) -> None:
    nxt = tmp_path / "next"
    nxt.mkdir()
    (nxt / "sitecustomize.py").write_text("print('next sitecustomize ran')\n")
    without = _run([nxt])
    assert without.returncode != 0 and "AttributeError" in without.stderr, without.stderr
    shimmed = _run([Path(shim_path(tmp_path)), nxt])
    assert shimmed.returncode == 0, shimmed.stderr
    assert shimmed.stdout.split() == ["next", "sitecustomize", "ran", "trained"]


def test_the_bf16_curve_reads_both_ranks_even_when_their_lines_run_together() -> None:
    log = ("[Rank 0] Step 0: loss=5.2188, time=0.066s, alloc_mem=0.00 GB\n"
           "[Rank 1] Step 0: loss=5.2188, time=0.082s\n"
           "[Rank 1] Step 1: loss=5.0000, time=0.022s, peak_mem=0.00 GB[Rank 0] Step 1: loss=4.9688, time=0.022s\n")
    assert _bf16_curve(log) == {0: 5.2188, 1: 5.2188, 2: 4.9688, 3: 5.0}
    assert _bf16_loss(log) == 4.9688
    assert _bf16_loss("no steps") is None
