"""Stage-3 ranks pairing up their gathers: checks that every rank gathers the same unit, in the same
kind of pass, in the same order, raised on every rank before their collectives pair wrongly.

See [Note: prefetch and the recorded order] in zero/stage3_hooks.py for when each check runs; the
kind of pass each check compares is the strategy's PassKind ([Note: the pass state] there).

[Note: paired passes]
A training forward on one rank and a forward without grad on another (a rank that generates while
the other trains, or that generates more tokens without synced_gpus) gather the same units in the
same order, so their collectives pair up and both forwards "work"; the divergence would surface at
the backward as a hang or wrong gradients. So every gather check also compares the kind of pass
(no-grad forward, training forward, backward) and raises at the first gather where they differ, on
every rank. Without the per-gather check (NCCL), each forward of the root compares the kind in one
16-byte all-reduce instead (a host sync per forward, not per gather). Forwards inside
GatheredParameters over every unit gather nothing and need no pairing, so they are not checked.
Stage-3 models carry `_is_fsdp_managed_module`, the flag transformers reads (with DeepSpeed's
ZeRO-3 config) to default `generate(synced_gpus=...)` to True: a rank that is done keeps running
forwards until every rank is.
"""

from __future__ import annotations

import torch

from zerodp import comm
from zerodp.zero.moe import leaf_hint
from zerodp.zero.trace import UnitTrace
from zerodp.zero.units import Unit

PASS_KINDS = ("a forward without grad (generation, evaluation)", "a training forward (grad enabled)", "a backward")
"""What ranks compare before a gather; stage 3 maps its PassKind onto these (a recomputation is a backward)."""


def check_same_unit(units: list[Unit], unit: Unit, kind: int) -> None:
    """Every rank is about to gather the same unit in the same kind of pass (`kind`, an index of
    PASS_KINDS, from the strategy's pass state), else raise naming them (one 16-byte all-gather)."""
    if comm.get_world_size() == 1 or comm.simulated():
        return
    row = torch.tensor([unit.index, kind], dtype=torch.int64, device=comm.device_for_backend())
    rows = comm.all_gather_rows(row).tolist()
    if len({i for i, _ in rows}) > 1:
        names = ", ".join(f"rank {r}: {units[i].name}" for r, (i, _) in enumerate(rows))
        hint = leaf_hint(units[0].module, [units[i].name for i, _ in rows])  # units[0]: the root, the model
        raise RuntimeError(f"ZeRO stage 3: ranks are about to gather different modules ({names}); every rank "
                           "must run the same modules in the same order (data-dependent control flow that "
                           f"differs between ranks cannot be sharded this way).{hint}")
    _raise_if_passes_differ([kind for _, kind in rows])


def check_same_kind_of_forward(kind: int) -> None:
    """Without the per-gather check (NCCL): one 16-byte all-reduce at each forward of the root
    (`kind`: this forward's index in PASS_KINDS)."""
    if comm.get_world_size() == 1 or comm.simulated():
        return
    counts = torch.zeros(len(PASS_KINDS), dtype=torch.int64, device=comm.device_for_backend())
    counts[kind] = 1
    comm.all_reduce(counts)
    if (counts > 0).sum().item() > 1:
        _raise_if_passes_differ([k for k, n in enumerate(counts.tolist()) for _ in range(n)], by_rank=False)


def check_same_order(trace: UnitTrace, units: list[Unit]) -> None:
    """One tiny all-reduce per backward: [hash, -hash] with MAX differs iff some rank ran its units
    in another order; then every rank's order is gathered and named."""
    if comm.get_world_size() == 1 or comm.simulated():
        return
    digest = trace.digest()
    stats = torch.tensor([digest, -digest], dtype=torch.int64, device=comm.device_for_backend())
    comm.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    if stats[0].item() == -stats[1].item():
        return
    with comm.ledger.outside_step():
        orders = comm.gather_messages(trace.describe([u.name for u in units]))
    lines = "\n".join(f"  rank {r}: {o}" for r, o in enumerate(orders))
    hint = leaf_hint(units[0].module, _first_difference([o.split(" -> ") for o in orders]))
    raise RuntimeError("ZeRO stage 3: ranks ran different modules in this forward/backward, so their "
                       "parameter gathers paired up wrongly and this micro-batch's results are invalid. "
                       f"Units run per rank (first difference marked):\n{lines}\nEvery rank must run the "
                       f"same modules in the same order; if a branch depends on the data, run it on every rank.{hint}")


def _first_difference(orders: list[list[str]]) -> list[str]:
    """Each rank's unit at the first position where the ranks' orders differ."""
    for position in range(max(len(o) for o in orders)):
        at = [o[position] if position < len(o) else "" for o in orders]
        if len(set(at)) > 1:
            return [name for name in at if name]
    return []


def _raise_if_passes_differ(kinds: list[int], by_rank: bool = True) -> None:
    if len(set(kinds)) == 1:
        return
    who = ", ".join(f"rank {r}: {PASS_KINDS[k]}" for r, k in enumerate(kinds)) if by_rank else \
        " and ".join(sorted({PASS_KINDS[k] for k in kinds}))
    raise RuntimeError(f"ZeRO stage 3: ranks are running different kinds of passes ({who}); their parameter "
                       "gathers would pair up wrongly. Every rank must run the same forwards and backwards; for "
                       "generate(), every rank must keep calling the model until all are done (synced_gpus=True, "
                       "which transformers sets itself for a zerodp stage-3 model), or generate inside "
                       "GatheredParameters(model.parameters()), which gathers nothing per forward")
