"""QLoRA's first pitfall: the 4-bit storage dtype (`bnb_4bit_quant_storage`) must be the training dtype.

zerodp casts floating parameters to the training dtype and stage 3 flattens them into a buffer of it; either
would change a 4-bit weight's packed codes held in another dtype (measured: fp16 storage under bf16 training
trained silently on wrong weights, fp32 storage failed inside bitsandbytes). `zerodp.initialize` refuses it
by name before any collective (zerodp/zero/four_bit.py); uint8 storage, no float, is left alone at stages 0-2.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from tests.test_qlora import base_dir  # noqa: E402,F401 - the tiny Llama fixture


def _model(base: str, storage: torch.dtype) -> torch.nn.Module:
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=storage,
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0)).train()


@pytest.mark.parametrize("storage,stage", [(torch.float16, 0), (torch.float32, 2), (torch.float16, 3), (torch.uint8, 3)])
def test_a_4bit_storage_other_than_the_training_dtype_is_refused(base_dir: str, storage: torch.dtype,  # noqa: F811
                                                                 stage: int) -> None:
    import zerodp

    model = _model(base_dir, storage)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match=rf"4-bit weight .*q_proj\.base_layer\.weight: its storage dtype "
                                         rf"\(bnb_4bit_quant_storage\) is {storage}, the training dtype is torch\.bfloat16"
                                         rf".*BitsAndBytesConfig\(\.\.\., bnb_4bit_quant_storage=torch\.bfloat16\)"):
        zerodp.initialize(model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad])


def test_uint8_storage_is_left_alone_below_stage_3(base_dir: str) -> None:  # noqa: F811
    from zerodp.zero.four_bit import check_4bit_storage

    model = _model(base_dir, torch.uint8)
    for stage in (0, 1, 2):
        check_4bit_storage(model, torch.bfloat16, stage)  # it trains: bitsandbytes' default storage, never cast
    check_4bit_storage(_model(base_dir, torch.bfloat16), torch.bfloat16, 3)
