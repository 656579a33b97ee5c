"""`zerodp estimate MODEL --quantization nf4 --lora-rank R`: QLoRA's model states per rank, before a run.

The 4-bit bytes are those bitsandbytes 0.50.2 holds (zerodp/plan/quantized.py's [Note: the bytes of one NF4
weight], checked against the real package when it is installed); the trainable count is PEFT's own for the
same model and targets; the per-rank categories follow from both by the model-state arithmetic.
"""

from __future__ import annotations

import json

import pytest
import torch

from zerodp.cli import main
from zerodp.plan.quantized import NF4_MAP_BYTES, nf4_packed_bytes, nf4_state_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_nf4_bytes_are_bitsandbytes_own() -> None:
    """A 300 x 1000 weight: what `QuantState.as_dict()` of bitsandbytes 0.50.2 held, without and with double
    quantization (measured once; rechecked against the package below when it is installed)."""
    assert nf4_packed_bytes(300_000) == 150_000
    assert nf4_state_bytes(300_000) == 18_752 + NF4_MAP_BYTES
    assert nf4_state_bytes(300_000, double_quant=True) == 4_688 + 76 + 1_024 + 4 + NF4_MAP_BYTES
    assert nf4_packed_bytes(7) == 4 and nf4_state_bytes(65) == 2 * 4 + NF4_MAP_BYTES  # partial byte, partial block


@pytest.mark.parametrize("shape", [(300, 1000), (64, 96), (36, 20)])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_bytes_against_bitsandbytes(shape: tuple[int, int], double_quant: bool) -> None:
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(*shape, dtype=torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4",
                                                 compress_statistics=double_quant, quant_storage=torch.bfloat16)
    held = sum(v.numel() * v.element_size() for v in state.as_dict(packed=False).values() if torch.is_tensor(v))
    held += 4 if double_quant else 0  # the nested offset, a float in as_dict, a 1-element fp32 tensor in the state
    assert packed.numel() * packed.element_size() == 2 * -(-nf4_packed_bytes(weight.numel()) // 2)
    assert held == nf4_state_bytes(weight.numel(), double_quant)


def _llama(tmp_path) -> tuple[str, transformers.LlamaConfig]:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    return str(tmp_path), config


def _rows(capsys, *argv: str) -> list[dict]:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("targets,peft_targets", [("all-linear", "all-linear"), ("q_proj,v_proj", ["q_proj", "v_proj"])])
def test_trainable_params_are_peft_s_count(tmp_path, capsys, targets: str, peft_targets) -> None:
    model, config = _llama(tmp_path)
    lora = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=peft_targets))
    expected = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    rows = _rows(capsys, model, "--quantization", "nf4", "--lora-rank", "4", "--lora-targets", targets,
                 "--world-size", "2")
    assert {r["trainable_params"] for r in rows} == {expected}
    assert {r["quantization"] for r in rows} == {"nf4"} and {r["deepspeed_bytes"] for r in rows} == {None}


def test_the_frozen_base_is_counted_in_4_bits_and_only_adapters_train(tmp_path, capsys) -> None:
    """Stage 0, bf16: the packed weights in their bf16 container are param4bit, the unquantized rest (embeddings,
    norms, the output layer) and the adapters param16; the statistics quant_state (the ledger's rows,
    tests/test_qlora_ledger.py); gradients, masters and Adam only for adapters. Stage 3 at 2 ranks shards the
    container; the statistics stay whole on every rank."""
    model, config = _llama(tmp_path)
    reference = transformers.LlamaForCausalLM(config)
    linears = [m for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    quantized = sum(m.weight.numel() for m in linears)
    container = sum(-(-nf4_packed_bytes(m.weight.numel()) // 2) for m in linears)
    rest = sum(p.numel() for p in reference.parameters()) - quantized
    adapters = sum(4 * (m.in_features + m.out_features) for m in linears)
    buffers = sum(b.numel() * b.element_size() for b in reference.buffers())
    rows = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r
            for r in _rows(capsys, model, "--quantization", "nf4", "--lora-rank", "4", "--world-size", "2")}
    stage0 = rows[(0, "none", "none")]["by_category"]
    assert stage0["param4bit (device)"] == 2 * container and stage0["param16 (device)"] == 2 * (rest + adapters)
    assert stage0["buffer (device)"] == buffers
    assert stage0["quant_state (device)"] == sum(nf4_state_bytes(m.weight.numel()) for m in linears)
    assert stage0["grad (device)"] == 2 * adapters and stage0["param32_master (device)"] == 4 * adapters
    stage3 = rows[(3, "none", "none")]
    assert stage3["by_category"]["quant_state (device)"] == stage0["quant_state (device)"]
    assert stage3["model_states_bytes"] < rows[(0, "none", "none")]["model_states_bytes"]


@pytest.mark.parametrize("argv,message", [
    (["--params", "7B", "--quantization", "nf4"], "--quantization nf4: give MODEL"),
    (["demo", "--lora-rank", "8"], "--lora-rank/--lora-targets/--double-quant: only with --quantization nf4"),
    (["demo", "--quantization", "nf4", "--lora-rank", "0"], "--lora-rank 0: expected a positive adapter rank"),
    (["demo", "--quantization", "nf4", "--seq-len", "8"], "--quantization nf4 estimates model states only"),
])
def test_bad_qlora_flags_are_named(capsys, argv: list[str], message: str) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_target_that_matches_no_linear_is_named(tmp_path, capsys) -> None:
    model, _ = _llama(tmp_path)
    assert main(["estimate", model, "--quantization", "nf4", "--lora-targets", "q_proj,qkv_proj"]) == 2
    assert "--lora-targets: no quantized Linear is called qkv_proj" in capsys.readouterr().err


def test_the_70b_table_of_memory_md(capsys) -> None:
    """docs/memory.md's QLoRA table is this command's output (GB = 10^9 bytes per rank)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "memory.md").read_text()
    argv = "docs/models/llama-70b --world-size 2 --quantization nf4 --lora-rank 8 --double-quant"
    assert f"zerodp estimate {argv}" in doc
    rows = _rows(capsys, str(root / "docs/models/llama-70b"), *argv.split()[1:])
    found = {r["strategy"]: (r["model_states_bytes"], r["host_bytes"]) for r in rows}
    assert {r["trainable_params"] for r in rows} == {103_546_880} and "103,546,880 adapter parameters" in doc
    for strategy, name in (("stage 0", "stage 0"), ("stage 2", "stage 2"), ("stage 3", "stage 3"),
                           ("stage 3, offload optimizer -> cpu", "stage 3, offload optimizer -> cpu"),
                           ("stage 3, offload optimizer -> cpu, params -> cpu",
                            "stage 3, offload optimizer and params -> cpu")):
        device, host = found[strategy]
        assert f"| {name} | {device / 1e9:.2f} | {host / 1e9:.2f} |".replace("| 0.00 |", "| 0 |") in doc, strategy


def _quantized_llama(tmp_path, **quantization) -> str:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_storage": "bfloat16",
                                  **quantization}
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_model_config_s_quantization_config_is_read(tmp_path, capsys) -> None:
    """A config.json with bitsandbytes' nf4 quantization_config (double quantization on) estimates as the flags
    would; an explicit --quantization none wins (the model trained in full)."""
    model = _quantized_llama(tmp_path)
    from_config = _rows(capsys, model, "--lora-rank", "4", "--world-size", "2")
    from_flags = _rows(capsys, model, "--quantization", "nf4", "--double-quant", "--lora-rank", "4", "--world-size", "2")
    assert from_config == from_flags and {r["quantization"] for r in from_config} == {"nf4"}
    without = _rows(capsys, model, "--lora-rank", "4", "--world-size", "2", "--quantization", "nf4")
    assert without == from_flags  # the config's double quantization, though the flag was not given
    full = _rows(capsys, model, "--quantization", "none", "--model-states-only")
    assert {r["quantization"] for r in full} == {"none"}
    assert full[0]["trainable_params"] == sum(p.numel() for p in transformers.LlamaForCausalLM(
        transformers.AutoConfig.from_pretrained(model)).parameters())


@pytest.mark.parametrize("quantization,argv,message", [
    ({"load_in_4bit": False, "load_in_8bit": True}, ["--quantization", "nf4"],
     "--quantization nf4: MODEL .*'s quantization_config is int8 \\(load_in_8bit\\), not nf4"),
    ({"bnb_4bit_quant_type": "fp4"}, [], "its quantization_config is fp4; zerodp estimate counts nf4 .* only"),
    ({"quant_method": "gptq"}, [], "its quantization_config is gptq"),
    ({"bnb_4bit_quant_storage": "uint8"}, [], "bnb_4bit_quant_storage is uint8, but --dtype bf16 trains in bfloat16"),
    ({}, ["--dtype", "fp16"], "bnb_4bit_quant_storage is bfloat16, but --dtype fp16 trains in float16"),
])
def test_a_conflicting_quantization_config_is_refused(tmp_path, capsys, quantization: dict, argv: list[str],
                                                      message: str) -> None:
    import re

    assert main(["estimate", _quantized_llama(tmp_path, **quantization), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_costs_candidates_with_the_quantized_model(tmp_path, capsys) -> None:
    """`zerodp plan --quantization nf4`: the simulated step is the QLoRA model's (4-bit base, adapters train), so a
    candidate's peak holds at least the estimator's QLoRA model states and less than full training's, and
    stage 0's gradient all-reduce carries the adapters only (4 bytes per trainable parameter on 2 ranks)."""
    model, config = _llama(tmp_path)
    estimated = {r["strategy"]: r for r in _rows(capsys, model, "--quantization", "nf4", "--lora-rank", "4",
                                                  "--world-size", "2")}
    argv = ["plan", model, "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "16", "--global-batch", "2",
            "--activation-checkpointing", "none", "--quantization", "nf4", "--lora-rank", "4", "--exhaustive", "--json"]
    assert main(argv) == 0
    candidates = {c["strategy"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert set(candidates) == {"stage 0", "stage 1", "stage 2", "stage 3"}
    full = {r["strategy"]: r for r in _rows(capsys, model, "--world-size", "2", "--model-states-only")}
    for strategy, c in candidates.items():
        assert estimated[strategy]["model_states_bytes"] < c["peak_bytes"] < full[strategy]["model_states_bytes"], \
            strategy
    assert candidates["stage 0"]["comm_bytes"] == 4 * estimated["stage 0"]["trainable_params"]


def test_plan_reads_the_model_config_s_quantization_config_as_estimate_does(tmp_path, capsys) -> None:
    """`zerodp plan` on a config.json with bitsandbytes' nf4 quantization_config plans the QLoRA model (with the
    config's double quantization), as the flags would; an explicit --quantization none wins."""
    model = _quantized_llama(tmp_path)
    argv = ["plan", model, "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "16", "--global-batch", "2",
            "--activation-checkpointing", "none", "--lora-rank", "4", "--top", "1", "--json"]

    def candidates(*flags: str) -> list[dict]:
        assert main([*argv, *flags]) == 0
        return json.loads(capsys.readouterr().out)["candidates"]

    from_config, from_flags = candidates(), candidates("--quantization", "nf4", "--double-quant")
    assert from_config == from_flags
    full = candidates("--quantization", "none")
    assert full[0]["strategy"] == from_config[0]["strategy"] and full[0]["comm_bytes"] > from_config[0]["comm_bytes"]


@pytest.mark.parametrize("quantization,argv,message", [
    ({"load_in_4bit": False, "load_in_8bit": True}, ["--quantization", "nf4"],
     "--quantization nf4: MODEL .*'s quantization_config is int8 \\(load_in_8bit\\), not nf4; drop the flag, or give "
     "--quantization none to plan the model unquantized"),
    ({"bnb_4bit_quant_type": "fp4"}, [], "its quantization_config is fp4; zerodp plan counts nf4 .* only"),
    ({"bnb_4bit_quant_storage": "uint8"}, [], "bnb_4bit_quant_storage is uint8, but --dtype bf16 trains in bfloat16"),
])
def test_plan_refuses_a_conflicting_quantization_config_as_estimate_does(tmp_path, capsys, quantization: dict,
                                                                         argv: list[str], message: str) -> None:
    import re

    assert main(["plan", _quantized_llama(tmp_path, **quantization), "--seq-len", "16", "--global-batch", "8",
                 *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
