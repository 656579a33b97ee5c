"""Hugging Face Trainer and accelerate run on zerodp with ZERODP_AS_DEEPSPEED=1 and no other change.

The jobs are ordinary user scripts (tests/scripts/), run with the real transformers, peft and
accelerate from the package registry on tiny models built from configs (no hub downloads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

for _library in ("transformers", "peft", "accelerate"):
    pytest.importorskip(_library, reason=f"{_library} is a test dependency (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"


ZERODP = [sys.executable, "-c", "from zerodp.cli import main; raise SystemExit(main())"]  # the `zerodp` command


def zerodp_run(num_ranks: int = 2) -> list[str]:
    """`zerodp run --nproc-per-node N`, from this interpreter."""
    return [*ZERODP, "run", "--nproc-per-node", str(num_ranks)]


def _launch(command: list[str], cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ZERODP_AS_DEEPSPEED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith('{"')]
    return json.loads(line)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_lora_bf16_resumes_bitwise_and_saves_what_it_trained(tmp_path: Path, stage: int) -> None:
    result = _launch([*zerodp_run(), str(SCRIPTS / "hf_trainer.py"), str(stage), str(tmp_path)], tmp_path)
    assert len(result["losses"]) == 4 and result["resumed_losses"] == result["losses"][2:]
    assert result["resumed_bitwise"] and result["num_lora"] == 4
    assert result["eval_loss"] < result["losses"][0]
    if stage == 3:  # evaluate() before any training: an engine without an optimizer
        assert abs(result["eval_before"] - result["untrained_loss"]) < 1e-6, result
    assert "adapter_model.safetensors" in result["saved"] and result["saved_matches"]
    assert {"config.json", "model.safetensors"} <= set(result["saved_full"]) and result["saved_full_matches"]


def test_an_accelerate_deepspeed_loop_at_stage_3(tmp_path: Path) -> None:
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    result = _launch([accelerate, "launch", "--use_deepspeed", "--zero_stage", "3", "--num_processes", "2",
                      "--mixed_precision", "bf16", "--zero3_save_16bit_model", "true",
                      "--gradient_accumulation_steps", "1", str(SCRIPTS / "accelerate_loop.py"), str(tmp_path)], tmp_path)
    assert result["engine"] == "zerodp.engine"
    assert result["after_load"] == result["after_save"]  # save_state / load_state round trip, bitwise
    assert result["state_matches"] and result["state_keys"] == 29
    assert "pytorch_model" in result["saved"] and "latest" in result["saved"]


def _train_gpt2(rank: int, world: int, base: str, out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import zerodp

    model = AutoModelForCausalLM.from_pretrained(base)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * rank + step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    engine.save_16bit_model(os.path.join(out, "weights16"), "model.safetensors")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_converted_and_16bit_weights_load_with_from_pretrained(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from tests.harness import run_ranks

    base = tmp_path / "base"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(base)
    trained = run_ranks(_train_gpt2, 2, args=(str(base), str(tmp_path)))[0]
    refused = subprocess.run([*ZERODP, "ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                              "--hf-config", str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 2 and "no config.json there" in refused.stderr and not (tmp_path / "hf").exists()
    subprocess.run([*ZERODP, "ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", str(base)],
                   check=True, capture_output=True)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # fp32 masters
    assert all(torch.equal(p, trained[n]) for n, p in converted.named_parameters())
    sixteen = AutoModelForCausalLM.from_pretrained(tmp_path / "weights16")  # save_16bit_model wrote config.json
    assert all(torch.equal(p, trained[n]) for n, p in sixteen.named_parameters())


def _sft(out: Path, *flags: str) -> dict:
    return _launch([*ZERODP, "deepspeed", "--num_gpus", "2", str(SCRIPTS / "ds_chat_sft.py"), "--out", str(out), *flags],
                   out.parent)


def test_a_deepspeed_chat_style_sft_loop_relaunches_from_its_checkpoint(tmp_path: Path) -> None:
    # zerodp deepspeed passes --local_rank; offload_param is set at stage 2 too; DeepSpeedCPUAdam with
    # offload_optimizer; save_zero_three_model's ds_id / ds_status gathering; a relaunch resumes bitwise
    straight = _sft(tmp_path / "a", "--offload", "--zero_stage", "3", "--steps", "4")
    _sft(tmp_path / "b", "--offload", "--zero_stage", "3", "--steps", "2")
    relaunched = _sft(tmp_path / "b", "--offload", "--zero_stage", "3", "--steps", "2", "--resume")
    assert relaunched["losses"] == straight["losses"][4:] and relaunched["global_steps"] == 4
    assert straight["full_shapes_ok"] and straight["optimizer"] == "DeepSpeedCPUAdam"
    stage2 = _sft(tmp_path / "c", "--offload", "--zero_stage", "2", "--steps", "1")
    assert stage2["full_shapes_ok"] and len(stage2["losses"]) == 2


def test_from_pretrained_under_zero3_loads_every_weight_into_the_partitions(tmp_path: Path) -> None:
    # transformers 5 builds on the meta device, then loads into deepspeed.zero.Init's partitions
    result = _launch([*zerodp_run(), str(SCRIPTS / "hf_from_pretrained.py"), str(tmp_path)], tmp_path)
    assert result["zero3_enabled"]
    assert result["gpt2"] == {"partitioned": True, "equal": True, "tied": True, "num_params": 28}
    assert result["llama"] == {"partitioned": True, "equal": True, "tied": False, "num_params": 21}
