"""The memory ledger of one QLoRA model at stages 0-3, per rank: guide §14c's figures.

    zerodp run --nproc-per-node 2 bench/qlora_ledger.py

The tiny Llama of tests/test_qlora_ledger.py (hidden 64, 2 layers, vocab 128, saved in bf16), loaded with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)`, PEFT
LoRA rank 4 on q_proj/v_proj, bf16, AdamW, stage3_param_persistence_threshold 0; one step at each stage, then
each rank prints `engine.memory_report()["held"]` (bytes on the device tier, by ledger category).
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import peft
import transformers

import zerodp


def _base(directory: str) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = _base(tmp)  # every rank its own copy of the same weights (same seed)
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                    bnb_4bit_quant_storage=torch.bfloat16,
                                                    bnb_4bit_compute_dtype=torch.bfloat16)
            model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant,
                                                                      dtype=torch.bfloat16)
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                               lora_dropout=0.0)).train()
            config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            engine, *_ = zerodp.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
            ids = torch.arange(8).view(1, 8) + dist.get_rank()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            report = engine.memory_report()
            held = ", ".join(f"{c} {t['device']:,}" for c, t in report["held"].items())
            for rank in range(dist.get_world_size()):
                if rank == dist.get_rank():
                    print(f"stage {stage} rank {rank}: {held} (model states {report['model_states']:,} bytes)",
                          flush=True)
                dist.barrier()


if __name__ == "__main__":
    main()
