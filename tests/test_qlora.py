"""QLoRA through `zerodp.initialize`: a 4-bit NF4 base (real bitsandbytes, its CPU backend) with PEFT adapters.

A tiny Llama saved in bf16, loaded with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_quant_storage=torch.bfloat16)`, LoRA on q/v, 2 ranks: every stage trains the same losses, bitwise
(bf16 adapters with fp32 masters; the frozen 4-bit storage is partitioned and gathered per unit at stage 3
with its quantization state intact), within a stated band of a single-process PEFT reference, and the
ledger counts the packed 4-bit bytes (`param4bit`), not 16-bit weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankFailed, run_ranks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

STEPS = 3
LR = 1e-2
REFERENCE_BAND = 1e-3
"""Largest loss difference allowed against the single-process reference: it keeps PEFT's fp32 adapters and
torch's AdamW on them, zerodp trains bf16 adapters from fp32 masters (measured: 2.3e-4 at most over 3 steps)."""


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("qlora") / "base"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _qlora_model(base: str) -> torch.nn.Module:
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model.train()  # from_pretrained returns eval mode: see test_a_module_replacing_gathered_data_is_named


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(STEPS)]


def _train(rank: int, base: str, stage: int, **zero: dict) -> dict:
    import zerodp

    model = _qlora_model(base)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerodp.initialize(model=model, config=config,
                                   model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = []
    for ids in _batches(rank):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "held": engine.memory_report()["held"]}


def _every_stage(rank: int, world_size: int, base: str) -> dict:
    first = _qlora_model(base)(input_ids=_batches(rank)[0], labels=_batches(rank)[0]).loss.item()
    runs = {stage: _train(rank, base, stage) for stage in (0, 1, 2, 3)}
    offload = _train(rank, base, 3, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    return {"unpartitioned_first_loss": first, "runs": runs, "stage3_again": _train(rank, base, 3)["losses"],
            "offload": offload}


def _reference(base: str) -> list[float]:
    """One process, both ranks' micro-batches as one batch, PEFT's fp32 adapters and torch's AdamW."""
    model = _qlora_model(base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids in (torch.cat(pair) for pair in zip(_batches(0), _batches(1))):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_qlora_trains_alike_at_every_stage(base_dir: str) -> None:
    results = run_ranks(_every_stage, 2, args=(base_dir,))
    for rank, result in enumerate(results):
        runs = result["runs"]
        # the first forward of every stage is the unpartitioned quantized model's, to the bit
        assert {run["losses"][0] for run in runs.values()} == {result["unpartitioned_first_loss"]}, rank
        for stage in (1, 2, 3):
            assert runs[stage]["losses"] == runs[0]["losses"], (rank, stage)
        assert result["stage3_again"] == runs[3]["losses"], rank  # two identical runs, bitwise
        assert result["offload"]["losses"] == runs[0]["losses"], rank  # the 4-bit shards on the host
    reference = _reference(base_dir)
    mean = [sum(r["runs"][3]["losses"][i] for r in results) / 2 for i in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean, reference)) < REFERENCE_BAND, (mean, reference)
    # the ledger holds the packed 4-bit storage (half a byte per weight), sharded over 2 ranks at stage 3
    model = _qlora_model(base_dir)
    packed = sum(p.numel() * p.element_size() for p in model.parameters() if hasattr(p, "quant_state"))
    others = sum(p.numel() * 2 for p in model.parameters() if not hasattr(p, "quant_state"))  # bf16 in training
    import bitsandbytes

    quantized = sum(m.weight.quant_state.shape.numel() for m in model.modules()
                    if isinstance(m, bitsandbytes.nn.Linear4bit))
    assert packed == quantized // 2
    held = [r["runs"] for r in results]  # the 4-bit storage is its own row (tests/test_qlora_ledger.py: every byte)
    assert held[0][0]["held"]["param4bit"]["device"] == packed and held[0][0]["held"]["param16"]["device"] == others
    assert sum(h[3]["held"]["param4bit"]["device"] + h[3]["held"]["param16"]["device"] for h in held) == packed + others
    assert sum(h[3]["held"]["param4bit"]["device"] for h in held) == packed
    assert sum(r["offload"]["held"]["param4bit"]["cpu"] for r in results) == packed


class _Replacing(torch.nn.Module):
    """Assigns its weight's `.data` in forward, as bitsandbytes' Linear4bit does in eval mode on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64, 64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data = self.weight.data.clone()
        return x @ self.weight


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Replacing(), _Replacing()])
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _replace_data(rank: int, world_size: int) -> None:
    import zerodp

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerodp.initialize(model=_Model(), config=config)
    engine.backward(engine(torch.ones(2, 64)))


def test_a_module_replacing_gathered_data_is_named() -> None:
    """Stage 3 would drop the new data at the release and gather the old one next time: refused, by name."""
    with pytest.raises(RankFailed, match=r"a module replaced the data of parameter weight \(unit blocks\.0\).*"
                                         r"call model\.train\(\)"):
        run_ranks(_replace_data, 2)


def test_qlora_through_the_trainer_at_stage_3(tmp_path) -> None:
    """tests/scripts/hf_qlora.py, unchanged user code under ZERODP_AS_DEEPSPEED=1: the Trainer trains a 4-bit
    base's adapters at ZeRO-3, resumes bitwise, and save_model writes the trained adapter, which reloads."""
    from tests.test_hf_integration import SCRIPTS, _launch, zerodp_run

    result = _launch([*zerodp_run(), str(SCRIPTS / "hf_qlora.py"), str(tmp_path)], tmp_path)
    assert len(result["losses"]) == 4 and result["resumed_losses"] == result["losses"][2:]
    assert result["resumed_bitwise"] and result["num_lora"] == 28 and result["lora_changed"]
    assert result["saved_matches"] and result["reloaded_matches"]
