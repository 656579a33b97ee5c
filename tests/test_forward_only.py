"""Engines that run forward only: no optimizer, or every parameter frozen (RLHF reference and reward
models, Trainer.evaluate() before train). Partitioned at stage 3, nothing held for training."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import RankFailed, run_ranks
from tests.models import batch, make_model

BF16 = {"bf16": {"enabled": True}}


def _config(stage: int, precision: str = "bf16", **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, **zero},
            **(BF16 if precision == "bf16" else {})}


def _forward_only(rank: int, world: int, stage: int, frozen: bool, offload: str | None, swap_dir: str,
                  precision: str):
    import zerodp

    model = make_model()
    reference = copy.deepcopy(model).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    if frozen:
        model.requires_grad_(False)
    param = {"device": offload, **({"nvme_path": swap_dir, "max_in_cpu": 0} if offload == "nvme" else {})}
    zero = {"stage3_param_persistence_threshold": 0, **({"offload_param": param} if offload else {})}
    config = _config(stage, precision, **(zero if stage == 3 else {}))
    if frozen:  # a shared config's optimizer: not built when nothing trains
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, optimizer, _, scheduler = zerodp.initialize(model=model, config=config)
    with torch.no_grad():
        outputs = [(engine(*batch(rank, s, 0)), reference(*batch(rank, s, 0))) for s in range(2)]
    errors = []
    for action in (lambda: engine.backward(engine(*batch(rank, 0, 0))), engine.step):
        try:
            action()
        except RuntimeError as err:
            errors.append(str(err))
    return (engine.forward_only, optimizer.param_groups, scheduler, [torch.equal(a, b) for a, b in outputs],
            engine.memory_report()["held"], errors)


def _unit_shard_numel(world: int) -> int:
    """Design formula at stage 3 (no persistent parameters): each module's own parameters form a unit
    whose flat buffer is cut into `world` equal shards."""
    model, seen, total = make_model(), set(), 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        total += -(-sum(p.numel() for p in own) // world)
    return total


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage, frozen, offload", [(0, False, None), (1, True, None), (2, False, None),
                                                    (3, False, None), (3, True, "cpu"), (3, False, "nvme")])
def test_a_forward_only_engine_matches_the_model_and_holds_nothing_for_training(tmp_path, stage, frozen,
                                                                                offload, precision) -> None:
    # the parameters: 16-bit in bf16; in fp32 the fp32 parameters are their own masters
    weights, size = ("param16", 2) if precision == "bf16" else ("param32_master", 4)
    for forward_only, groups, scheduler, equal, held, errors in run_ranks(
            _forward_only, 2, args=(stage, frozen, offload, str(tmp_path), precision)):
        assert forward_only and groups == [] and scheduler is None
        assert all(equal)  # bitwise the unsharded model's outputs, in the same dtype
        assert set(held) <= {weights, "buffer"}, held  # no gradients, optimizer state (or 16-bit copies in fp32)
        if stage == 3:
            assert held[weights] == {(offload or "device"): size * _unit_shard_numel(2)}
        else:
            assert held[weights] == {"device": size * sum(p.numel() for p in make_model().parameters())}
        assert len(errors) == 2 and all("runs forward only" in e for e in errors), errors
        reason = "every parameter of the model is frozen" if frozen else "built without an optimizer"
        assert all(reason in e for e in errors)


def _frozen_with_an_optimizer(rank: int, world: int):
    import zerodp

    model = make_model().requires_grad_(False)
    zerodp.initialize(model=model, config=_config(2), optimizer=torch.optim.AdamW(model.parameters()))


def test_an_optimizer_for_a_frozen_model_is_still_an_error() -> None:
    with pytest.raises(RankFailed, match="the model has no trainable parameters"):
        run_ranks(_frozen_with_an_optimizer, 1)


def _held(rank: int, world: int, precision: str) -> dict:
    import zerodp

    engine, *_ = zerodp.initialize(model=make_model(), config=_config(0, precision))
    return engine.memory_report()["held"]


def test_the_inference_doc_names_the_ledger_rows_of_a_forward_only_engine() -> None:
    """docs/inference.md once said a forward-only engine holds no fp32 masters while its fp32 ledger
    shows `param32_master` (the category of fp32 weights, counted once); the doc must name each row."""
    from pathlib import Path

    section = (Path(__file__).resolve().parent.parent / "docs" / "inference.md").read_text()
    section = section[section.index("## Forward-only engines"):section.index("## Generation at ZeRO-3")]
    numel = sum(p.numel() for p in make_model().parameters())
    for precision, weights, size in (("fp32", "param32_master", 4), ("bf16", "param16", 2)):
        held = run_ranks(_held, 1, args=(precision,), timeout=120)[0]
        assert set(held) <= {weights, "buffer"} and held[weights] == {"device": size * numel}, held
        assert f"`{weights}`" in section, weights
    assert "fp32 masters or optimizer state" not in section  # the old claim, contradicted by the ledger
