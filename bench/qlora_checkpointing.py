"""Gradient checkpointing with a frozen 4-bit base under zerodp: which settings train, and whether alike.

    python bench/qlora_checkpointing.py

The tiny QLoRA Llama of tests/test_qlora.py (NF4, bf16 storage, LoRA rank 4 on q_proj/v_proj), 2 ranks, 3 steps
of AdamW lr 1e-2, at stages 0 and 3, with transformers' `gradient_checkpointing_enable` off, with
`use_reentrant` True and False, and each with the input hook `enable_input_require_grads` (which
transformers 5.25 installs itself for a model fed input_ids) left on or removed (`disable_input_require_grads`).
Prints rank 0's losses per case, or the error.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import run_ranks  # noqa: E402


def _model(base: str, reentrant: bool | None, input_grads: bool) -> torch.nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if not input_grads:
            model.disable_input_require_grads()
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0)).train()


def _train(rank: int, world_size: int, base: str, stage: int, reentrant: bool | None, input_grads: bool) -> list:
    import zerodp

    model = _model(base, reentrant, input_grads)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerodp.initialize(model=model, config=config,
                                   model_parameters=[p for p in model.parameters() if p.requires_grad])
    losses = []
    for _ in range(3):
        ids = torch.arange(8).view(1, 8) + rank
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        cases = [(None, True), (True, True), (True, False), (False, True), (False, False)]
        for stage in (0, 3):
            for reentrant, input_grads in cases:
                what = "no checkpointing" if reentrant is None else \
                    f"use_reentrant={reentrant}, input hook {'on' if input_grads else 'removed'}"
                try:
                    losses = run_ranks(_train, 2, args=(tmp, stage, reentrant, input_grads), timeout=300)[0]
                    print(f"stage {stage}, {what}: losses {' '.join(f'{x:.6f}' for x in losses)}", flush=True)
                except Exception as err:  # noqa: BLE001 - the case's own failure is the measurement
                    print(f"stage {stage}, {what}: {str(err).strip().splitlines()[-1][:200]}", flush=True)


if __name__ == "__main__":
    main()
