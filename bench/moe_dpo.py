"""TRL's DPOTrainer with a mixture-of-experts policy on zerodp: stage 3 against stage 0, per-expert modules
and transformers' fused experts.

    python bench/moe_dpo.py [--stages 0,3] [--policies experts,moe]

tests/scripts/trl_dpo.py on 2 processes (ZERODP_AS_DEEPSPEED=1, bf16, 4 steps, TRL's reference model):
- experts: tests/moe_hf.py's DeepSeek-style policy, an nn.ModuleList of 8 expert modules (top-2) per
  block, loaded through the Auto classes like remote code; the ranks call different experts;
- moe: a tiny Qwen3-MoE (transformers 5's fused experts; TRL adds the router's auxiliary loss).
Stage 0 replicates the parameters (no gathering: the reference for the stage-3 run). The table gives
each run's loss and rewards/margins per step and the largest difference of stage 3 from stage 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hf_vs_deepspeed import curves  # noqa: E402
from tests.test_hf_integration import SCRIPTS, _launch, zerodp_run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="0,3", help="ZeRO stages; the first is the reference (default 0,3)")
    parser.add_argument("--policies", default="experts,moe", help="experts, moe or both (default)")
    args = parser.parse_args()
    print("| policy | stage | loss per step | rewards/margins per step |")
    print("|---|---|---|---|")
    for policy in args.policies.split(","):
        runs = {}
        for stage in args.stages.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                runs[stage] = curves("dpo", _launch([*zerodp_run(), str(SCRIPTS / "trl_dpo.py"), stage, tmp, policy],
                                                    Path(tmp)))
            shown = [", ".join(f"{x:.7g}" for x in runs[stage][k]) for k in ("loss", "rewards/margins")]
            print(f"| {policy} | {stage} | {shown[0]} | {shown[1]} |", flush=True)
        first, *others = runs.values()
        for stage, other in zip(list(runs)[1:], others):
            diff = max(abs(x - y) for k in first for x, y in zip(first[k], other[k]))
            print(f"| {policy} | {stage} vs {list(runs)[0]} | largest difference {diff:.2e} | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
