"""QLoRA (a 4-bit NF4 base, real bitsandbytes on its CPU backend, PEFT adapters) with offload, 2 ranks, bf16.

Each offload of the config (`offload_optimizer` cpu / nvme at stages 2 and 3, `offload_param` cpu / nvme at
stage 3) trains the losses and adapters of the same run without it, bitwise: offload moves the fp32 masters, the
Adam state and the shards, it does not change the arithmetic (the CPU optimizer is the same torch AdamW on the
same fp32 values). The 4-bit base and its quantization state come back unchanged, and the ledger puts each
row on the tier the config names. `engine.offload_states()` / `reload_states()` move every model state of a
QLoRA engine, its 4-bit storage and quant_state too, and bring them back bitwise. Reentrant activation
checkpointing behind the frozen base is refused by name (zero/four_bit.py).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.test_qlora import LR, STEPS, _batches, _qlora_model  # noqa: E402  (after the importorskips)
from tests.test_qlora import base_dir  # noqa: E402, F401  (the fixture: the same tiny bf16 Llama)


def _engine(model: torch.nn.Module, stage: int, zero: dict):
    import zerodp

    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerodp.initialize(model=model, config=config,
                                   model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _step(engine, ids: torch.Tensor) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s bytes: 4-bit codes in a bf16 container read as bf16 hold NaNs, which torch.equal
    would call different from themselves."""
    return t.detach().clone().reshape(-1).view(torch.uint8)


def _base(model: torch.nn.Module) -> list[torch.Tensor]:
    """The bytes of the 4-bit weights (gathered at stage 3) and of their quantization state."""
    import zerodp
    from zerodp.memory import is_quantized, quant_state_tensors

    quantized = [p for p in model.parameters() if is_quantized(p)]
    with zerodp.zero.GatheredParameters(quantized):
        return [_bytes(t) for t in quantized + quant_state_tensors(quantized)]


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import zerodp

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with zerodp.zero.GatheredParameters(list(trainable.values())):
        return {n: p.detach().clone() for n, p in trainable.items()}


def _train(rank: int, base: str, stage: int, zero: dict) -> dict:
    model = _qlora_model(base)
    initial = _base(model)
    engine = _engine(model, stage, zero)
    losses = [_step(engine, ids) for ids in _batches(rank)]
    after = _base(model)
    return {"losses": losses, "adapters": _adapters(model), "base_unchanged": len(after) == len(initial) and all(
        torch.equal(a, b) for a, b in zip(after, initial)), "held": engine.memory_report()["held"]}


def _runs(rank: int, world_size: int, base: str, variants: dict) -> dict:
    return {name: _train(rank, base, stage, zero) for name, (stage, zero) in variants.items()}


def _variants(device: str, nvme_path: str) -> dict:
    """name -> (stage, zero_optimization keys), with the run without offload at both stages."""
    section = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    params = {**section, **({"max_in_cpu": 0} if device == "nvme" else {})}  # else the tiny shards stay in memory
    return {"stage 2": (2, {}), "stage 3": (3, {}), "stage 2 optimizer": (2, {"offload_optimizer": section}),
            "stage 3 param and optimizer": (3, {"offload_param": params, "offload_optimizer": section})}


def _tier(held: dict, category: str) -> set[str]:
    return {tier for tier, b in held[category].items() if b}


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_qlora_offload_trains_bitwise_like_no_offload(tmp_path, base_dir: str, device: str) -> None:
    variants = _variants(device, str(tmp_path))
    for rank, runs in enumerate(run_ranks(_runs, 2, args=(base_dir, variants))):
        for name, (stage, zero) in variants.items():
            run, plain = runs[name], runs[f"stage {stage}"]
            assert run["losses"] == plain["losses"], (rank, name)
            assert run["adapters"].keys() == plain["adapters"].keys(), (rank, name)
            assert all(torch.equal(run["adapters"][n], a) for n, a in plain["adapters"].items()), (rank, name)
            assert run["base_unchanged"], (rank, name)  # the 4-bit codes and their state, after the round trips
            held = run["held"]
            param_tier = zero["offload_param"]["device"] if "offload_param" in zero else "device"
            assert _tier(held, "param4bit") == _tier(held, "param16") == {param_tier}, (rank, name, held)
            assert _tier(held, "quant_state") == {"device"}, (rank, name, held)  # used by every dequantize
            if "offload_optimizer" in zero:  # the step counters stay in host memory beside the NVMe state
                assert _tier(held, "param32_master") == {device} and device in _tier(held, "optim_state"), held
                assert _tier(held, "optim_state") <= {"cpu", device}, (rank, name, held)
            else:
                assert _tier(held, "param32_master") == _tier(held, "optim_state") == {"device"}, (rank, name, held)
            for category, tiers in held.items():  # offload moves bytes, it adds none
                assert sum(tiers.values()) == sum(plain["held"][category].values()), (rank, name, category)


def _round_trip(rank: int, world_size: int, base: str, stage: int) -> dict:
    from zerodp.memory import MODEL_STATE_CATEGORIES, nbytes

    plain = _engine(_qlora_model(base), stage, {})
    expected = [_step(plain, ids) for ids in _batches(rank)], _adapters(plain.module)
    engine = _engine(_qlora_model(base), stage, {})
    losses = [_step(engine, _batches(rank)[0])]
    before = engine.strategy.ledger()
    states = [(t, _bytes(t)) for held in before.tensors.values() for t in held]
    # a from_pretrained weight torch does not own (the safetensors file mapped in, on CPU) is not torch's to free
    mapped = sum(nbytes(t) for (c, tier), held in before.tensors.items() if c in MODEL_STATE_CATEGORIES
                 and tier == "device" for t in held if not t.untyped_storage().resizable())
    engine.offload_states()
    during = engine.strategy.ledger()
    try:
        engine(input_ids=_batches(rank)[1])
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    engine.reload_states()
    back = all(torch.equal(_bytes(t), copy) for t, copy in states)
    losses += [_step(engine, ids) for ids in _batches(rank)[1:]]
    device = [sum(led.bytes(c, "device") for c in MODEL_STATE_CATEGORIES) for led in (before, during)]
    moved = {c.value: (before.bytes(c, "device"), during.bytes(c, "device"), during.bytes(c, "cpu") -
                       before.bytes(c, "cpu")) for c in MODEL_STATE_CATEGORIES}
    return {"expected": expected, "got": (losses, _adapters(engine.module)), "back": back, "device": device,
            "mapped": mapped, "moved": moved, "refused": refused}


@pytest.mark.parametrize("stage", [0, 3])
def test_offload_states_moves_the_4bit_base_and_brings_it_back_bitwise(base_dir: str, stage: int) -> None:
    for rank, r in enumerate(run_ranks(_round_trip, 2, args=(base_dir, stage))):
        (losses, adapters), (got_losses, got_adapters) = r["expected"], r["got"]
        assert got_losses == losses and all(torch.equal(got_adapters[n], a) for n, a in adapters.items()), rank
        assert r["back"], rank  # every ledger tensor, the 4-bit codes and quant_state included, bitwise
        assert "call engine.reload_states() first" in r["refused"], r["refused"]
        assert r["device"][1] == r["mapped"], (rank, r["device"], r["mapped"])  # only the mapped file stays
        assert (r["mapped"] > 0) == (stage == 0), r["mapped"]  # stage 3 copied every weight into its flats
        for category in ("param4bit", "quant_state", "optim_state", "param32_master"):
            before, during, to_cpu = r["moved"][category]
            assert before > 0 and during == 0 and to_cpu == before, (rank, category, r["moved"][category])


def _checkpointed_model(base: str, every_n_layers: int, hook: bool, reentrant: bool) -> torch.nn.Module:
    model = _qlora_model(base)
    model.base_model.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant}, every_n_layers=every_n_layers)
    if not hook:  # transformers >= 5 installs it; older ones (and other checkpointing code) did not
        model.base_model.model.disable_input_require_grads()
    return model


REFUSED = (r"activation checkpointing of base_model\.model\.model\.layers\.0 is reentrant.*"
           r"model\.enable_input_require_grads\(\).*'use_reentrant': False")


@pytest.mark.parametrize("every_n_layers", [1, 2], ids=["every-layer", "layer-0-only"])
def test_reentrant_checkpointing_behind_a_frozen_base_is_refused_by_name(base_dir: str, every_n_layers: int) -> None:
    # every layer: torch's own "element 0 of tensors does not require grad" at backward; layer 0 only: its
    # adapters got no gradient and stayed unchanged without a word. Now refused, naming both fixes.
    from zerodp.zero.four_bit import check_reentrant_checkpointing

    with pytest.raises(ValueError, match=REFUSED):
        check_reentrant_checkpointing(_checkpointed_model(base_dir, every_n_layers, hook=False, reentrant=True))


def test_a_trainable_parameter_outside_the_layers_makes_it_a_warning(base_dir: str, caplog) -> None:
    """A trainable parameter before the layers (a multimodal projector) could give them inputs that need grad."""
    from zerodp.zero.four_bit import check_reentrant_checkpointing

    model = _checkpointed_model(base_dir, 1, hook=False, reentrant=True)
    model.base_model.model.lm_head.weight.requires_grad_(True)
    check_reentrant_checkpointing(model)
    assert any("such as base_model.model.lm_head.weight" in r.getMessage() for r in caplog.records)


def _checkpointed_runs(rank: int, world_size: int, base: str) -> list:
    runs = [_engine(_qlora_model(base), 0, {})]
    for hook, reentrant in ((True, True), (False, False)):
        runs.append(_engine(_checkpointed_model(base, 1, hook, reentrant), 0, {}))
    losses = [[_step(e, ids) for ids in _batches(rank)] for e in runs]
    try:
        _engine(_checkpointed_model(base, 2, hook=False, reentrant=True), 0, {})
    except ValueError as err:
        return losses + [str(err)]
    return losses + [""]


def test_initialize_refuses_it_and_either_fix_trains_the_losses_of_no_checkpointing(base_dir: str) -> None:
    plain, input_hook, non_reentrant, refused = run_ranks(_checkpointed_runs, 1, args=(base_dir,))[0]
    assert input_hook == plain and non_reentrant == plain
    assert re.search(REFUSED, refused), refused  # before any collective
