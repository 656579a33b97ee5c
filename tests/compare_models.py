"""Models `zerodp compare` trains in tests/test_compare.py (module:function specs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.demo import DEMO_DEFAULT, TinyGPT


class FailsOnRankOne(TinyGPT):
    """The demo's GPT, whose forward raises on rank 1 only: the other rank waits in a collective."""

    def forward(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1's forward fails on purpose")
        return super().forward(*args, **kwargs)

    def estimate_inputs(self, micro_batch: int, seq_len: int):
        ids = torch.randint(0, DEMO_DEFAULT.vocab_size, (micro_batch, seq_len))
        return (ids, ids), {}


def fails_on_rank_one() -> FailsOnRankOne:
    return FailsOnRankOne(DEMO_DEFAULT)
