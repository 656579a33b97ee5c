"""Real frameworks' own scripts, unchanged, on zerodp through the DeepSpeed drop-in (ZERODP_AS_DEEPSPEED=1).

- transformers' examples/pytorch/language-modeling/run_clm.py with `--deepspeed` and the ZeRO-3 "auto"
  config of transformers' DeepSpeed guide: a tiny Llama from a local config, a local BPE tokenizer and
  local text (tests/framework_inputs.py), 4 steps saving at step 2, then `--resume_from_checkpoint`
  checkpoint-2: the resumed run's losses and saved weights equal the uninterrupted run's bitwise.
- TRL's trl/scripts/sft.py under `accelerate launch --config_file` TRL's own ZeRO-3 accelerate config.

run_clm.py belongs to transformers and is not in this repository: the test reads it from the checkout
$ZERODP_TRANSFORMERS_SRC names and is skipped, saying so, without one. bench/frameworks.py runs the
same jobs (and DeepSpeed-Chat's, LLaMA-Factory's) on a real DeepSpeed too and compares the losses.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.framework_inputs import make_inputs, python_path, run_clm_args, trl_sft_args

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 400


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("tokenizers", reason="the tokenizer is trained with `tokenizers` (a transformers dependency)")
    return make_inputs(tmp_path_factory.mktemp("framework-inputs"), with_weights=True)


def _env(inputs: dict[str, Path], cache: Path) -> dict[str, str]:
    return {**os.environ, "ZERODP_AS_DEEPSPEED": "1", "PYTHONPATH": python_path(REPO, inputs["shims"]),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}


def _launch(command: list[str], env: dict, log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    assert done.returncode == 0, log.read_text()[-4000:]


def _losses(output_dir: Path) -> dict[int, float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_run_clm_zero3_auto_resumes_bitwise(inputs: dict[str, Path], tmp_path: Path) -> None:
    src = os.environ.get("ZERODP_TRANSFORMERS_SRC")
    script = Path(src or ".") / "examples" / "pytorch" / "language-modeling" / "run_clm.py"
    if not src or not script.exists():
        pytest.skip("run_clm.py is transformers' own and not in this repository: set ZERODP_TRANSFORMERS_SRC to a "
                    f"transformers checkout (found {script if src else 'ZERODP_TRANSFORMERS_SRC unset'})")
    pytest.importorskip("datasets", reason="run_clm.py loads the text with `datasets`")
    env = _env(inputs, tmp_path / "hf-datasets")
    _launch([*_torchrun(), str(script), *run_clm_args(inputs, tmp_path / "full", 4, 2)], env, tmp_path / "full.log")
    straight = _losses(tmp_path / "full")
    assert sorted(straight) == [1, 2, 3, 4] and all(math.isfinite(v) for v in straight.values()), straight
    assert straight[4] < straight[1], straight
    checkpoint = tmp_path / "full" / "checkpoint-2"
    # zerodp's checkpoint (partitioned over both ranks) in the folder HF's resume looks for, with the
    # consolidation script DeepSpeed users run
    assert (checkpoint / "global_step2" / "rank_1_of_2.pt").is_file() and (checkpoint / "zero_to_fp32.py").is_file()
    _launch([*_torchrun(), str(script), *run_clm_args(inputs, tmp_path / "resumed", 4, 2),
             "--resume_from_checkpoint", str(checkpoint)], env, tmp_path / "resumed.log")
    resumed = _losses(tmp_path / "resumed")
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)], (resumed, straight)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "the resumed weights differ"


def test_trl_sft_under_accelerate_launch_zero3(inputs: dict[str, Path], tmp_path: Path) -> None:
    trl = pytest.importorskip("trl", reason="trl is a test dependency (pip install -e '.[test]')")
    pytest.importorskip("accelerate", reason="accelerate is a test dependency (pip install -e '.[test]')")
    script = Path(trl.__file__).parent / "scripts" / "sft.py"
    config = Path(trl.__file__).parent / "accelerate_configs" / "zero3.yaml"
    if not script.exists() or not config.exists():
        pytest.skip(f"this trl ({trl.__version__}) ships no {script.name} / {config.name}")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", "2", str(script), *trl_sft_args(inputs, tmp_path / "out", 4)]
    _launch(command, _env(inputs, tmp_path / "hf-datasets"), tmp_path / "sft.log")
    losses = _losses(tmp_path / "out" / "checkpoint-4")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    # the engine was zerodp's, partitioned over both ranks: its own checkpoint layout, one shard per rank
    shards = sorted(p.name for p in (tmp_path / "out" / "checkpoint-4" / "global_step4").iterdir())
    assert {"meta.json", "rank_0_of_2.pt", "rank_1_of_2.pt"} <= set(shards), shards
