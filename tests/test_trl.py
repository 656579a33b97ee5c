"""TRL's DPOTrainer and GRPOTrainer run on zerodp through the DeepSpeed drop-in (ZERODP_AS_DEEPSPEED=1),
unchanged, at ZeRO stages 2 and 3 in bf16, with tiny models built from configs (tests/scripts/trl_*.py).

The reference model is TRL's own: it hands it to `deepspeed.initialize` without an optimizer, and zerodp
builds a forward-only engine (partitioned at stage 3). GRPO generates inside the training loop, at stage 3
inside `deepspeed.zero.GatheredParameters(model.parameters())` with zerodp's forward hooks removed and
reinstalled by TRL. bench/trl_vs_deepspeed.py runs the same scripts on DeepSpeed and compares the curves.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl is a test dependency (pip install -e '.[test]')")

from tests.test_hf_integration import SCRIPTS, _launch, zerodp_run  # noqa: E402


@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_with_its_reference_model(tmp_path: Path, stage: int) -> None:
    result = _launch([*zerodp_run(), str(SCRIPTS / "trl_dpo.py"), str(stage), str(tmp_path)], tmp_path)
    logs = result["logs"]
    assert len(logs) == 4
    # the policy starts equal to the reference model: DPO's loss is exactly -log(sigmoid(0)) = log 2
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-6 and logs[0]["rewards/chosen"] == 0 == logs[0]["rewards/margins"]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.05 and logs[-1]["rewards/margins"] > 0.1, logs
    assert result["ref_model"] == "zerodp.engine" and result["ref_forward_only"] is True


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_generates_inside_the_loop(tmp_path: Path, stage: int) -> None:
    result = _launch([*zerodp_run(), str(SCRIPTS / "trl_grpo.py"), str(stage), str(tmp_path)], tmp_path)
    logs = result["logs"]
    assert len(logs) == 3 and all(0 <= row["reward"] <= 1 for row in logs)
    assert logs[0]["kl"] == 0 and all(row["kl"] > 0 for row in logs[1:]), logs  # the policy moved off the reference
    assert result["ref_model"] == "zerodp.engine"
