"""One comm ledger per engine ([Note: one comm ledger per engine] in zerodp/comm/ledger.py).

Two engines in one process (RLHF's actor and reference, a GAN's generator and discriminator) run their
forwards, backwards and steps interleaved; each engine's `comm_report()` must show its own traffic, cut
at its own step boundaries, exactly as when it runs alone in the process.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.models import batch, make_block_lm, make_model

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
STAGE2 = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, **ADAMW}
STAGE3 = {"train_micro_batch_size_per_gpu": 4, **ADAMW,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _train_interleaved(rank: int, names: str, direct_backward: bool) -> dict[str, dict]:
    """Engines "a" (stage 2, TiedMLP) and/or "b" (stage 3, BlockLM); two steps in which every
    engine's forward runs before any backward and every backward before any step. With
    `direct_backward`, the backwards are plain `loss.backward()` calls, which only the strategies'
    hooks see."""
    import zerodp

    builders = {"a": (make_model, STAGE2), "b": (make_block_lm, STAGE3)}
    engines = {n: zerodp.initialize(model=builders[n][0](), config=builders[n][1])[0] for n in names}
    for step in range(2):
        losses = {n: engine(*batch(rank, step, 0)) for n, engine in engines.items()}
        for n, engine in engines.items():
            if direct_backward:
                losses[n].backward()
            else:
                engine.backward(losses[n])
        for engine in engines.values():
            engine.step()
    return {n: engine.comm_report() for n, engine in engines.items()}


def _alone_and_together(rank: int, world: int, direct_backward: bool) -> tuple[dict, dict]:
    alone = {**_train_interleaved(rank, "a", direct_backward), **_train_interleaved(rank, "b", direct_backward)}
    return alone, _train_interleaved(rank, "ab", direct_backward)


@pytest.mark.parametrize("direct_backward", [False, True])
def test_each_engine_reports_its_own_step_when_two_engines_interleave(direct_backward: bool) -> None:
    for alone, together in run_ranks(_alone_and_together, 2, args=(direct_backward,), timeout=200):
        for name in "ab":
            for phase in ("last_step", "init", "one_off"):
                assert together[name][phase] == alone[name][phase], (name, phase, together[name][phase],
                                                                      alone[name][phase])
        a, b = together["a"]["last_step"]["ops"], together["b"]["last_step"]["ops"]
        # stage 2 reduces per owner and gathers once; stage 3 also gathers in forward and backward
        assert a["reduce[float32]"]["calls"] > 0 and b["all_gather[float32]"]["calls"] > a["all_gather[float32]"]["calls"]


def _process_ledger_still_counts_everything(rank: int, world: int) -> tuple[int, int, int]:
    import zerodp
    from zerodp import comm

    engines = [zerodp.initialize(model=m, config=c)[0] for m, c in ((make_model(), STAGE2), (make_block_lm(), STAGE3))]
    for engine in engines:  # one whole step each: the process's step is cut at each engine's boundary
        engine.backward(engine(*batch(rank, 0, 0)))
        engine.step()
        if engine is engines[0]:
            first = comm.ledger.last_step
    outside = torch.ones(3)
    comm.all_reduce(outside)  # a script's own collective between steps: counts for the engine that ran last
    extra = engines[1].comm_ledger.current[("all_reduce", "float32")].numel
    return (sum(r.bytes for r in first.values()), engines[0].comm_report()["last_step"]["total_bytes"], extra)


def test_the_process_ledger_keeps_its_step_cuts_and_a_script_s_collective_counts_for_the_last_engine() -> None:
    for process_step, engine_step, extra in run_ranks(_process_ledger_still_counts_everything, 2, timeout=200):
        assert process_step == engine_step > 0
        assert extra == 6  # an all-reduce of 3 elements counts 2 x 3
