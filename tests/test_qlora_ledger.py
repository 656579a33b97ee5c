"""The memory ledger of a QLoRA model, byte for byte: the 4-bit frozen storage (`param4bit`), its quantization
state (`quant_state`: absmax and code maps, which live beside the parameter, not in it), and the adapters'
parameters, gradients, fp32 masters and Adam state, per rank at stages 0 and 3 on 2 ranks, against a hand
computation from the model's own tensors; and `zerodp estimate --quantization nf4` for the same model equals it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_ranks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
RANK = 4
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qlora_ledger") / "base"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _model(base: str, double_quant: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=double_quant,
                                            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=TARGETS, lora_dropout=0.0)).train()


def _ledgers(rank: int, world_size: int, base: str, double_quant: bool) -> dict:
    import zerodp

    out = {}
    for stage in (0, 3):
        model = _model(base, double_quant)
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = zerodp.initialize(model=model, config=config,
                                       model_parameters=[p for p in model.parameters() if p.requires_grad])
        ids = torch.arange(8).view(1, 8) + rank
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        flats = [] if stage == 0 else [
            {"numels": [p.ds_numel for p in f.params], "quantized": [hasattr(p, "quant_state") for p in f.params],
             "trains": f is unit.trainable, "keep_full": f.keep_full}
            for unit in engine.strategy.units for f in unit.flats]
        out[stage] = {"held": engine.memory_report()["held"], "flats": flats}
    return out


def _hand(model: torch.nn.Module) -> dict:
    """The model's own tensors, before any engine: 4-bit storage bytes, the quantization states' bytes, the other
    frozen elements, the adapters' elements and tensors, the buffers' bytes."""
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    states = []
    for m in linears:
        qs = m.weight.quant_state
        states += [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"packed": sum(m.weight.numel() * m.weight.element_size() for m in linears),
            "quant_state": sum(t.numel() * t.element_size() for t in states),
            "frozen_numel": sum(p.numel() for p in model.parameters() if not p.requires_grad
                                and not hasattr(p, "quant_state")),
            "lora_numel": sum(p.numel() for p in trainable), "lora_tensors": len(trainable),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}


def _stage3_expected(flats: list[dict], rank: int, h: dict) -> dict:
    """Rank `rank`'s bytes at stage 3 on 2 ranks: each flat padded to an even length and halved; bf16 storage."""
    held = {"param4bit": 0, "param16": 0, "grad": 0, "param32_master": 0, "optim_state": 0}
    for f in flats:
        total = sum(f["numels"])
        padded = total + total % 2
        lo, hi = (0, padded) if f["keep_full"] else (rank * padded // 2, (rank + 1) * padded // 2)
        offset, quantized, owned = 0, 0, 0
        for numel, q in zip(f["numels"], f["quantized"]):
            overlap = max(0, min(hi, offset + numel) - max(lo, offset))
            quantized, owned, offset = quantized + q * overlap, owned + overlap, offset + numel
        held["param4bit"] += 2 * quantized
        held["param16"] += 2 * (hi - lo - quantized)
        if f["trains"]:
            held["grad"] += 2 * (hi - lo)
            held["param32_master"] += 4 * (hi - lo)
            held["optim_state"] += 8 * owned + 4 * (owned > 0)  # Adam's two moments; a step counter per piece
    return held


@pytest.fixture(scope="module", params=[False, True], ids=["absmax-fp32", "double-quant"])
def runs(request, base_dir: str) -> tuple[bool, list[dict]]:
    """(double quantization, each rank's ledgers at stages 0 and 3), run once for both tests."""
    return request.param, run_ranks(_ledgers, 2, args=(base_dir, request.param))


def test_the_ledger_counts_4bit_storage_and_quant_state_exactly(base_dir: str, runs) -> None:
    double_quant, results = runs
    h = _hand(_model(base_dir, double_quant))
    stage0 = {"param4bit": h["packed"], "param16": 2 * (h["frozen_numel"] + h["lora_numel"]),
              "grad": 2 * h["lora_numel"], "param32_master": 4 * h["lora_numel"],
              "optim_state": 8 * h["lora_numel"] + 4 * h["lora_tensors"], "quant_state": h["quant_state"],
              "buffer": h["buffers"]}
    for rank, result in enumerate(results):
        held = {c: tiers["device"] for c, tiers in result[0]["held"].items()}
        assert held == stage0, (rank, held, stage0)
        expected = _stage3_expected(result[3]["flats"], rank, h)
        held = {c: tiers["device"] for c, tiers in result[3]["held"].items()}
        assert held == {**expected, "quant_state": h["quant_state"], "buffer": h["buffers"]}, (rank, held, expected)
    # stage 3: the 4-bit storage is sharded, every byte of it once over the ranks; its state is whole on each
    assert sum(r[3]["held"]["param4bit"]["device"] for r in results) == h["packed"]


def _estimated(base: str, double_quant: bool, stage: int) -> dict:
    """`zerodp estimate`'s arithmetic for the same model (its config.json on the meta device, QLoRA applied) at
    the runtime's config: 2 ranks, bf16, stage3_param_persistence_threshold 0 (the CLI's default is 1e5)."""
    from zerodp.plan.model_states import StrategySpec, buffer_bytes, flat_states, module_flats
    from zerodp.plan.quantized import QLoRA, apply_qlora
    from zerodp.plan.workload import workload

    module = workload(base).meta()
    apply_qlora(module, QLoRA(RANK, tuple(TARGETS), double_quant), 2)
    flats = module_flats(module, stage, 2, persistence_threshold=0)
    states = flat_states(flats, 2, StrategySpec(stage), buffer_bytes=buffer_bytes(module))
    return {c: b for (c, tier), b in states.held.items() if tier == "device"}


def test_the_estimate_is_the_ledger_to_the_byte(base_dir: str, runs, capsys) -> None:
    """Rank 0's ledger at stages 0 and 3 equals the estimator's figure for rank 0, category by category; the
    CLI's stage-0 row is the same figure."""
    from zerodp.cli import main

    double_quant, results = runs
    for stage in (0, 3):
        held = {c: tiers["device"] for c, tiers in results[0][stage]["held"].items()}
        assert _estimated(base_dir, double_quant, stage) == held, stage
    argv = ["estimate", base_dir, "--quantization", "nf4", "--lora-rank", str(RANK), "--lora-targets",
            ",".join(TARGETS), "--world-size", "2", "--json"] + ["--double-quant"] * double_quant
    assert main(argv) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["strategy"] == "stage 0")
    assert row["model_states_bytes"] == sum(t["device"] for c, t in results[0][0]["held"].items())
