"""The runs docs/guide.md quotes, one subcommand per question (issue 39). Each prints what the guide shows.

Distributed ones run under the launcher; the others in one process (a world of 1):

    zerodp run --nproc-per-node 2 bench/guide_runs.py ddp        # 8: zerodp stage 0 against torch DDP
    python bench/guide_runs.py seq                               # 26: saved activations against sequence length
    python bench/guide_runs.py optimizer                         # 36: optimizer and scheduler from the config
    zerodp run --nproc-per-node 2 bench/guide_runs.py loop       # 39-41: initialize, backward, step
    zerodp run --nproc-per-node 2 bench/guide_runs.py accum      # 42: traffic per step against accumulation
    zerodp run --nproc-per-node 2 bench/guide_runs.py overlap    # 63, 64: the step's parts, medians
    zerodp run --nproc-per-node 2 bench/guide_runs.py lora DIR   # 45: LoRA's ledger and save against full
    zerodp run --nproc-per-node 2 bench/guide_runs.py ckpt-save DIR     # 47-54: train 3, save, train 3
    zerodp run --nproc-per-node 2 bench/guide_runs.py ckpt-resume DIR   # 51: load, train 3 (2 ranks)
    python bench/guide_runs.py ckpt-resume DIR                   # 52: the same checkpoint on 1 rank
    /work/benchvenv/bin/python bench/guide_runs.py ds-batch      # 37: what DeepSpeed says (a real DeepSpeed)

Every model is the demo's TinyGPT (805,632 parameters) or a smaller one, fp32 unless said otherwise,
on this machine's CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BROKEN = {  # question 38: a stock ZeRO-3 config with its "auto"s filled in by hand, three mistakes in it
    "train_batch_size": 128, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0, "fp16": {"enabled": True, "initial_scale_power": 16}, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "stage3_prefetch_bucket_szie": 5e7, "stage3_gather_16bit_weights_on_model_save": True}}
ADAMW = {"lr": 2e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": True}


def _demo(seq_len: int | None = None, **shape):
    """The demo's GPT (or one of another shape) and its copy-task data."""
    from dataclasses import replace

    from zerodp.demo import DEMO_DEFAULT, SyntheticTaskDataset, TinyGPT

    config = replace(DEMO_DEFAULT, **({"seq_len": seq_len} if seq_len else {}), **shape)
    torch.manual_seed(0)
    return TinyGPT(config), SyntheticTaskDataset(512, config.seq_len, config.vocab_size, seed=0)


def _batch(data, rank: int, step: int, micro: int, size: int = 8):
    """Micro-batch `micro` of optimizer step `step` on `rank`: fixed samples, no sampler involved."""
    start = ((step * 4 + micro) * 2 + rank) * size % (len(data) - size)
    idx, targets = zip(*(data[i] for i in range(start, start + size)))
    return torch.stack(idx), torch.stack(targets)


def lora(out: str) -> None:
    """Question 45: a tiny Hugging Face Llama (no download), full fine-tuning against LoRA (r 8 on q_proj and
    v_proj), stage 3, bf16, 2 ranks: each rank's ledger after one step, and what a save writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerodp

    shape = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}
    for name in ("full", "lora"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(shape)
        if name == "lora":
            model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        engine, *_ = zerodp.initialize(model=model, config=config)
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(engine.global_rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        held = {k: sum(v.values()) for k, v in engine.memory_report()["held"].items()}
        sizes = {}
        for exclude in (False, True):  # frozen weights go to engine.pt, the trainable ones' shards to rank files
            tag = f"exclude_frozen_parameters={exclude}"
            engine.save_checkpoint(f"{out}/{name}", tag=tag, exclude_frozen_parameters=exclude)
            sizes[tag] = sum(f.stat().st_size for f in Path(out, name, tag).iterdir())
        if engine.global_rank == 0:
            print(f"{name}: {trainable:,} of {total:,} parameters trainable; rank 0 holds "
                  + ", ".join(f"{k} {v:,}" for k, v in sorted(held.items()))
                  + f" bytes (model states {engine.memory_report()['model_states']:,}); a save: "
                  + ", ".join(f"{k} {v:,} bytes" for k, v in sizes.items()))


def ddp() -> None:
    """Question 8: 10 steps of torch DDP + AdamW against zerodp stage 0 with the same AdamW, clipping at 1.0."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import zerodp

    zerodp.init_distributed()
    rank = dist.get_rank()
    reference, data = _demo()
    ddp_model = DistributedDataParallel(reference)
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    model, _ = _demo()
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW),
                                   config={"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0})
    same_losses = True
    for step in range(10):
        idx, targets = _batch(data, rank, step, 0)
        loss = ddp_model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mine = engine(idx, targets)
        engine.backward(mine)
        engine.step()
        same_losses &= mine.item() == loss.item()
    theirs = dict(reference.named_parameters())
    differ = [n for n, p in model.named_parameters() if not torch.equal(p, theirs[n])]
    gap = max((p - theirs[n]).abs().max().item() for n, p in model.named_parameters())
    if rank == 0:
        print(f"10 steps, 2 ranks, fp32: losses equal at every step: {same_losses}; parameters that differ: "
              f"{len(differ)} of {len(theirs)}; largest difference {gap}; last loss {loss.item():.6f}")


def seq() -> None:
    """Question 26: bytes autograd saves for one sample's backward, by sequence length: the demo's width and
    depth, one rank, micro-batch 1; attention by torch's fused SDPA kernel (what the demo runs), by the math
    kernel (the (seq x seq) attention matrix materialised, as eager attention does), and the fused kernel
    with every block checkpointed. Seconds of the second step beside each."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import zerodp

    print(f"{'seq_len':>8} {'fused':>12} {'per token':>10} {'math':>12} {'per token':>10} {'fused+blocks':>13}"
          f" {'s fused':>8} {'s math':>7} {'s blocks':>9}")
    for seq_len in (128, 256, 512, 1024, 2048):
        row = []
        for policy, kernel in (("none", None), ("none", SDPBackend.MATH), ("blocks", None)):
            model, data = _demo(seq_len)
            if policy == "blocks":
                zerodp.checkpointing.apply(model, policy="blocks")
            engine, *_ = zerodp.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
            for step in range(2):
                start = time.perf_counter()
                with sdpa_kernel(kernel) if kernel is not None else nullcontext():
                    engine.backward(engine(*_batch(data, 0, step, 0, size=1)))
                engine.step()
            row.append((sum(engine.memory_report()["activations"].values()), time.perf_counter() - start))
        (fused, t_fused), (math, t_math), (blocks, t_blocks) = row
        print(f"{seq_len:>8} {fused:>12,} {fused / seq_len:>10,.0f} {math:>12,} {math / seq_len:>10,.0f} {blocks:>13,}"
              f" {t_fused:>8.3f} {t_math:>7.3f} {t_blocks:>9.3f}")


def optimizer() -> None:
    """Question 36: what the config's optimizer and scheduler sections build, and who wins when the
    script passes its own too."""
    import zerodp

    config = {"train_micro_batch_size_per_gpu": 8,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}
    model, _ = _demo()
    _, opt, _, sched = zerodp.initialize(model=model, config=config)
    print(f"from the config: optimizer {type(opt).__name__} (fused={opt.defaults.get('fused')}, "
          f"lr {opt.param_groups[0]['lr']}), scheduler {type(sched).__name__}")
    model, _ = _demo()
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt, _, sched = zerodp.initialize(model=model, optimizer=mine, config=config)
    print(f"the script's SGD and the config's AdamW section: optimizer {type(opt).__name__} "
          f"(lr {opt.param_groups[0]['lr']}), scheduler {type(sched).__name__}")
    model, _ = _demo()
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt, _, sched = zerodp.initialize(model=model, optimizer=mine, config={
        "train_micro_batch_size_per_gpu": 8, "scheduler": config["scheduler"]})
    print(f"the script's SGD with the config's scheduler: optimizer {type(opt).__name__}, "
          f"scheduler {type(sched).__name__}, lr after 0 steps {opt.param_groups[0]['lr']}")


def loop() -> None:
    """Questions 39-41: what initialize returns, where the accumulation boundary falls, and what a bare
    optimizer.step() leaves undone (stage 2, 2 ranks, accumulation 2)."""
    import zerodp

    model, data = _demo()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "zero_optimization": {"stage": 2}}
    returned = zerodp.initialize(model=model, config=config, training_data=data)
    engine, opt, loader, sched = returned
    rank0 = engine.global_rank == 0
    if rank0:
        print("initialize returns:", ", ".join(type(x).__name__ for x in returned),
              f"| sampler {type(loader.sampler).__name__}, {len(loader)} micro-batches per rank")
        print(f"the optimizer's parameters: {sum(p.numel() for g in opt.param_groups for p in g['params']):,} "
              f"elements (the module has {sum(p.numel() for p in model.parameters()):,})")
    batches = iter(loader)
    for micro in range(2):
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(engine(*next(batches)))
        engine.step()
        if rank0:
            print(f"micro-batch {micro}: boundary {boundary}, global_steps after engine.step() {engine.global_steps}")
    before = [p.detach().clone() for p in model.parameters()]
    for micro in range(2):
        engine.backward(engine(*next(batches)))
    opt.step()  # what a script written for plain torch would call instead of engine.step()
    moved = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if rank0:
        print(f"two micro-batches then a bare optimizer.step(): {moved} of {len(before)} module parameters "
              f"changed; global_steps {engine.global_steps}")


def accum() -> None:
    """Question 42: bytes each rank sends per optimizer step at stages 1 and 2, accumulating 1, 2, 4 micro-batches."""
    import zerodp

    for stage in (1, 2):
        for gas in (1, 2, 4):
            model, data = _demo()
            engine, *_ = zerodp.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas,
                "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "zero_optimization": {"stage": stage}})
            for micro in range(gas):
                engine.backward(engine(*_batch(data, engine.global_rank, 0, micro)))
                engine.step()
            report = engine.comm_report()["last_step"]
            if engine.global_rank == 0:
                ops = ", ".join(f"{op} {rec['calls']} x" for op, rec in report["ops"].items())
                print(f"stage {stage}, accumulation {gas}: {report['total_bytes']:>10,} bytes per step ({ops})")


def overlap() -> None:
    """Questions 63 and 64: medians over 8 steps (after 2 warm-up steps) of the step's parts, at stages 0, 1
    and 2 with micro-batch 8, and at stage 2 with micro-batch 1."""
    import zerodp

    for stage, micro_batch in ((0, 8), (1, 8), (2, 8), (2, 1)):
        model, data = _demo()
        engine, *_ = zerodp.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "zero_optimization": {"stage": stage}})
        parts: dict[str, list[float]] = {}
        for step in range(10):
            engine.backward(engine(*_batch(data, engine.global_rank, step, 0, size=micro_batch)))
            engine.step()
            report = engine.step_report()
            for key in ("seconds", "forward", "backward", "communication_exposed", "communication_overlapped",
                        "optimizer"):
                parts.setdefault(key, []).append(report[key] * 1000)
        if engine.global_rank == 0:
            med = {k: statistics.median(v[2:]) for k, v in parts.items()}
            tokens = 2 * micro_batch * data.seq_len
            print(f"stage {stage}, micro-batch {micro_batch}: " + " | ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f" ms | {tokens / med['seconds'] * 1000:,.0f} tokens/s")


def ckpt_save(out: str) -> None:
    """Questions 47-54: stage 3, 2 ranks: 3 steps, save, 3 more steps (the losses a resume must repeat);
    a plain torch.save of the module beside it."""
    import zerodp

    model, data = _demo()
    engine, *_ = zerodp.initialize(model=model, config=_ckpt_config(), training_data=data)
    batches = iter(engine.training_dataloader)  # one pass: the saved position is where the next batch comes from
    losses = _train(engine, batches, 3)
    start = time.perf_counter()
    engine.save_checkpoint(out)
    seconds = time.perf_counter() - start
    losses += _train(engine, batches, 3)
    if engine.global_rank == 0:
        full, _ = _demo()
        torch.save(full.state_dict(), Path(out) / "torch_state_dict.pt")
        Path(out, "losses.json").write_text(json.dumps(losses))
        print(f"save_checkpoint: {seconds:.2f} s; losses of steps 1-6: {losses}")


def ckpt_resume(out: str) -> None:
    """Questions 51-52: load the checkpoint at this world size, train 3 steps, compare with steps 4-6."""
    import zerodp

    model, data = _demo()
    config = _ckpt_config()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        config["gradient_accumulation_steps"] = 2  # 1 rank: keep the 16 samples a step of 2 ranks took
    engine, *_ = zerodp.initialize(model=model, config=config, training_data=data)
    path, _ = engine.load_checkpoint(out)
    with torch.no_grad():  # the restored weights, on one fixed batch: equal at any world size
        probe = engine(*_batch(data, 0, 99, 0)).item()
    sampler = engine.training_dataloader.sampler
    resume_at = sampler._resume_at  # the per-rank count the checkpoint recorded
    losses = _train(engine, iter(engine.training_dataloader), 3)
    if engine.global_rank == 0:
        saved = json.loads(Path(out, "losses.json").read_text())[3:]
        print(f"after the load: loss on a fixed batch {probe!r}; the loader resumed at index {resume_at} "
              f"of rank 0's share ({sampler.num_replicas} rank(s))")
        print(f"loaded {path} at {engine.world_size} rank(s), stage {engine.zero_optimization_stage()}, global_steps "
              f"{engine.global_steps - 3} -> {engine.global_steps}; losses {losses}; bitwise those of the "
              f"uninterrupted run: {losses == saved}; largest difference {max(abs(a - b) for a, b in zip(losses, saved))}")


def _ckpt_config() -> dict:
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}


def _train(engine, batches, steps: int) -> list[float]:
    """`steps` optimizer steps from `batches` (the engine's loader); each step's loss averaged over every
    micro-batch of every rank (the same 16 samples at any world size)."""
    import torch.distributed as dist

    losses = []
    for _ in range(steps):
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(*next(batches))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        if engine.world_size > 1:
            dist.all_reduce(total)
        losses.append(round((total / (engine.world_size * engine.gradient_accumulation_steps())).item(), 8))
    return losses


def ds_batch() -> None:
    """Question 37: a real DeepSpeed's config check on an inconsistent batch and on a derived one that
    floors to 0, at a data-parallel world size of 8 (one process; the world size comes from an mpu)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29731"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")

    class EightRanks:
        def get_data_parallel_world_size(self) -> int:
            return 8

    for name, config in (("bad_batch.json", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                             "gradient_accumulation_steps": 2}),
                         ("floor.json", {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}),
                         ("broken.json", BROKEN)):
        try:
            DeepSpeedConfig(config, mpu=EightRanks())
            print(f"DeepSpeed {deepspeed.__version__}, {name}: accepted")
        except Exception as error:  # noqa: BLE001  (whatever DeepSpeed raises is what the guide quotes)
            print(f"DeepSpeed {deepspeed.__version__}, {name}: {type(error).__name__}: {error}")


def main(argv: list[str] | None = None) -> None:
    commands = {"ddp": ddp, "seq": seq, "optimizer": optimizer, "loop": loop, "accum": accum, "overlap": overlap,
                "ds-batch": ds_batch}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=[*commands, "ckpt-save", "ckpt-resume", "lora", "broken-config"])
    parser.add_argument("dir", nargs="?", default="guide_ckpt", help="checkpoint directory (ckpt-save, ckpt-resume, lora)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "broken-config":  # question 38's file, for `zerodp config check`
        print(json.dumps(BROKEN, indent=2))
    elif args.command == "ckpt-save":
        ckpt_save(args.dir)
    elif args.command == "lora":
        lora(args.dir)
    elif args.command == "ckpt-resume":
        ckpt_resume(args.dir)
    else:
        commands[args.command]()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
