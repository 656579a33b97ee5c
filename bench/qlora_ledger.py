"""The memory ledger of one QLoRA model at stages 0-3, per rank: guide §14c's figures.

    zerodp run --nproc-per-node 2 bench/qlora_ledger.py

The tiny Llama of tests/test_qlora_ledger.py (hidden 64, 2 layers, vocab 128, saved in bf16), loaded with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)`, PEFT
LoRA rank 4 on q_proj/v_proj, bf16, AdamW, stage3_param_persistence_threshold 0; one step at each stage, then
each rank prints `engine.memory_report()["held"]` (bytes on the device tier, by ledger category). Then the same
step with each offload of the config (tests/test_qlora_offload.py checks each trains bitwise like none): each
rank prints its model-state bytes (buffers aside) per tier (device / cpu / nvme).
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


def _offloads(nvme_path: str) -> dict[str, tuple[int, dict]]:
    """name -> (stage, zero_optimization keys) of the offload runs."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {"stage 2, offload_optimizer cpu": (2, {"offload_optimizer": {"device": "cpu"}}),
            "stage 3, offload_optimizer cpu": (3, {"offload_optimizer": {"device": "cpu"}}),
            "stage 3, offload_param + offload_optimizer cpu": (3, {"offload_param": {"device": "cpu"},
                                                                  "offload_optimizer": {"device": "cpu"}}),
            "stage 3, offload_param + offload_optimizer nvme": (3, {"offload_param": {**nvme, "max_in_cpu": 0},
                                                                   "offload_optimizer": nvme})}


def _print_in_rank_order(line: str) -> None:
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            print(line, flush=True)
        dist.barrier()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = _base(tmp)  # every rank its own copy of the same weights (same seed)
        zerodp.init_distributed()
        shared = [tmp]  # the ranks' configs must agree: rank 0's folder holds every rank's swap files
        dist.broadcast_object_list(shared, src=0)
        runs = {f"stage {stage}": (stage, {}) for stage in (0, 1, 2, 3)}
        for name, (stage, zero) in {**runs, **_offloads(shared[0])}.items():
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
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
            engine, *_ = zerodp.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
            ids = torch.arange(8).view(1, 8) + dist.get_rank()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            report = engine.memory_report()
            rank = dist.get_rank()
            if not zero:
                held = ", ".join(f"{c} {t['device']:,}" for c, t in report["held"].items())
                _print_in_rank_order(f"{name} rank {rank}: {held} (model states {report['model_states']:,} bytes)")
                continue
            tiers = {tier: sum(t.get(tier, 0) for c, t in report["held"].items() if c != "buffer")
                     for tier in ("device", "cpu", "nvme")}
            _print_in_rank_order(f"{name} rank {rank}: model states "
                                 + ", ".join(f"{tier} {b:,}" for tier, b in tiers.items()) + " bytes")


if __name__ == "__main__":
    main()
