"""Does the offload diagnosis's advice pick the faster configuration? (engine.step_report()["offload"])

    python bench/offload_advice.py --nvme-path DIR            # 3 rounds, ~2 min on this machine

One rank trains tests/test_step_report.py's Flat model (12.8M fp32 parameters, next to no compute:
every step swaps 154 MB of AdamW state in and out of NVMe) at stage 2 with NVMe optimizer offload,
for several `sub_group_size` / `buffer_count` settings, interleaved over `--rounds`. For each it
prints the median step time and the settings the last step's advice names, so the advice can be
checked against the measured step times of the configurations it points to.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import zerodp  # noqa: E402
from tests.test_step_report import Flat  # noqa: E402

POINTS = [(4, 100_000), (4, 1_000_000), (4, 3_200_000), (4, 1_000_000_000), (1, 1_000_000)]  # (buffer_count, sub_group_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", required=True, help="a folder on the disk to swap to")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="per point and round; the first is dropped")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29556", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      ZERODP_LOG_LEVEL="WARNING")
    times: dict = {}
    advice: dict = {}
    for round_ in range(args.rounds):
        for buffers, sub_group in POINTS:
            config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": 2, "sub_group_size": sub_group, "offload_optimizer": {
                          "device": "nvme", "nvme_path": args.nvme_path, "buffer_count": buffers}}}
            engine, *_ = zerodp.initialize(model=Flat(), config=config)
            reports = []
            for _ in range(args.steps):
                engine.backward(engine(torch.tensor(1.0)))
                engine.step()
                reports.append(engine.step_report())
            times.setdefault((buffers, sub_group), []).extend(r["seconds"] for r in reports[1:])
            advice[(buffers, sub_group)] = [a["text"][:110] for a in reports[-1]["offload"]["advice"]]
            engine.destroy()
            print(f"round {round_ + 1}: buffer_count {buffers}, sub_group_size {sub_group:,}", flush=True)
    print(f"\n{'buffer_count':>12} {'sub_group_size':>15} {'median s/step':>14}  advice of the last step")
    for (buffers, sub_group), seconds in times.items():
        print(f"{buffers:>12} {sub_group:>15,} {statistics.median(seconds):>14.3f}  "
              + (" | ".join(advice[(buffers, sub_group)]) or "-"))


if __name__ == "__main__":
    main()
